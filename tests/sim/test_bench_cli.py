"""A small deterministic `bench policies --quick` run through the CLI: structure and ordering facts."""

import json
import math

import pytest
import typer
from typer.testing import CliRunner

from pipeline.core.sim.families import FIXED_WINDOW
from pipeline.core.sim.scenario_file import parse_scenario
from pipeline.core.sim.search import Candidate, Evaluator
from pipeline.tools.commands import bench

SCENARIO = """
name = "tiny"
seed = 5
slo_p99_ms = 400.0

[[phases]]
duration_s = 3
rate_per_s = 150
bursts = { every_s = 1.5, duration_s = 0.3, rate_per_s = 400 }

[cost]
points = [[1, 6.0], [4, 12.0], [8, 22.0], [16, 60.0], [48, 220.0], [128, 700.0]]

[priority]
mix = [0.3, 0.7]
"""

app = typer.Typer()
bench.register(app)

FIELDS = {
    "policy",
    "config",
    "throughput_rps",
    "throughput_tokens_per_s",
    "p50_ms",
    "p99_ms",
    "p999_ms",
    "queue_wait_p99_ms",
    "share_wait_over_1s",
    "hit_ratio",
    "hit_ratio_busy",
    "hit_ratio_idle",
    "mean_batch_size",
    "marked_share",
    "marked_p99_ms",
    "unmarked_p99_ms",
    "capacity_at_slo",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    (d / "tiny.toml").write_text(SCENARIO)
    out = d / "out.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "policies",
            "--scenario",
            str(d / "tiny.toml"),
            "--quick",
            "--json",
            str(out),
            "--plot",
            str(d / "plots"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "batchtide-default" in result.output
    assert len(list((d / "plots").glob("*.png"))) == 3
    return json.loads(out.read_text())


def test_report_structure(report):
    assert report["scenario"] == "tiny"
    assert report["physical_limit_rps"] == pytest.approx(8 / 22.0 * 1000)
    assert report["simulator_requests_per_s"] > 0
    names = [p["policy"] for p in report["policies"]]
    assert names[:7] == ["fixed-window", "triton", "tf-serving", "torchserve", "ray-serve", "bentoml", "clipper"]
    assert {"batchtide", "batchtide-default", "batchtide-nomark", "seed-baseline"} <= set(names)
    for p in report["policies"]:
        assert set(p) >= FIELDS


def test_ordering_facts(report):
    limit = report["physical_limit_rps"]
    for p in report["policies"]:
        assert p["p50_ms"] <= p["p99_ms"] <= p["p999_ms"]
        assert p["throughput_rps"] <= limit * 1.02
        assert 0 <= p["hit_ratio"] <= 1 and 0 <= p["marked_share"] <= 1
        assert p["capacity_at_slo"] > 0
    nomark = next(p for p in report["policies"] if p["policy"] == "batchtide-nomark")
    assert nomark["marked_share"] == 0


def test_same_run_same_json(report, tmp_path):
    (tmp_path / "tiny.toml").write_text(SCENARIO)
    out = tmp_path / "again.json"
    CliRunner().invoke(
        app, ["bench", "policies", "--scenario", str(tmp_path / "tiny.toml"), "--quick", "--json", str(out)]
    )
    again = json.loads(out.read_text())
    assert again["policies"] == report["policies"]


def test_best_of_family_beats_every_config_of_its_grid():
    s = parse_scenario(
        {
            "name": "g",
            "seed": 2,
            "slo_p99_ms": 300.0,
            "phases": [{"duration_s": 2, "rate_per_s": 300}],
            "cost": {"points": [[1, 5.0], [8, 20.0], [32, 120.0]]},
        }
    )
    ev = Evaluator(s)
    cands = [Candidate("fixed-window", c) for c in FIXED_WINDOW.quick_grid]
    best = ev.best_of(cands)
    alone = Evaluator(s)
    for c in cands:
        full = alone.evaluate(c)
        assert best.capacity_k >= full.capacity_k
        if full.capacity_k == best.capacity_k:
            assert best.nominal.p99_ms <= full.nominal.p99_ms or math.isclose(best.nominal.p99_ms, full.nominal.p99_ms)


def test_bad_scenario_exits_with_a_message(tmp_path):
    (tmp_path / "bad.toml").write_text('name = "x"\n[cost]\na_ms = 1.0\nc_ms = 0.1\n')
    result = CliRunner().invoke(app, ["bench", "policies", "--scenario", str(tmp_path / "bad.toml")])
    assert result.exit_code == 2
    assert "needs at least one [[phases]]" in result.output


def test_goodput_table_where_requests_carry_deadlines():
    from pipeline.core.sim.families import families
    from pipeline.tools.bench.goodput import GOODPUT_LOADS, goodput_table

    s = parse_scenario(
        {
            "name": "d",
            "seed": 4,
            "slo_p99_ms": 200.0,
            "deadline_ms": 300.0,
            "phases": [{"duration_s": 2, "rate_per_s": 500}],
            "cost": {"points": [[1, 5.0], [8, 20.0], [32, 60.0]]},
        }
    )
    ev = Evaluator(s)
    rows = goodput_table(ev, s, quick=True)
    assert [r["load"] for r in rows] == [round(1.02**k, 3) for k in GOODPUT_LOADS]
    for k, row in zip(GOODPUT_LOADS, rows, strict=True):
        peers = {n: f for n, f in row["families"].items() if n != "batchtide"}
        assert row["best_peer"]["goodput_rps"] == max(f["goodput_rps"] for f in peers.values())
        for family in families():
            for cfg in family.configs(s, True):
                assert (
                    ev.at_load(Candidate(family.name, cfg), k).goodput_rps
                    <= row["families"][family.name]["goodput_rps"]
                )
        mine = row["batchtide_default"]
        assert row["ratio"] == pytest.approx(mine["goodput_rps"] / row["best_peer"]["goodput_rps"])
        assert 0 <= mine["good_share"] <= 1 - mine["expired_share"] + 1e-9
    assert rows[-1]["batchtide_default"]["expired_share"] > 0, "x2 load overloads the device: some are shed"
    plain = parse_scenario(
        {
            "name": "p",
            "seed": 4,
            "slo_p99_ms": 200.0,
            "phases": [{"duration_s": 1, "rate_per_s": 100}],
            "cost": {"a_ms": 1.0, "c_ms": 0.1},
        }
    )
    assert goodput_table(Evaluator(plain), plain, quick=True) == [], "no deadlines: no goodput table"
