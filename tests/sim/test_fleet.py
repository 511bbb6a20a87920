"""The simulated consumer group: layout, forwarding's effect, conservation, validation, the CLI."""

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from pipeline.core.sim.arrivals import make_arrivals
from pipeline.core.sim.consumer_group import fleet_variant, simulate_fleet
from pipeline.core.sim.fleetmetrics import measure_fleet
from pipeline.core.sim.fleetspec import range_assignment, weighted_assignment
from pipeline.core.sim.scenario import ScenarioError
from pipeline.core.sim.scenario_file import parse_scenario
from pipeline.tools.commands import bench


def fleet_scenario(fleet=None, consumers=2, rate=300.0, duration=10, **extra):
    """The live straggler's shape (t(b) = 20 + 2b ms, 4 partitions), shortened."""
    data = {
        "name": "fleet-unit",
        "seed": 24,
        "phases": [{"duration_s": duration, "rate_per_s": rate}],
        "cost": {"a_ms": 20.0, "c_ms": 2.0},
        "topology": {"consumers": consumers},
        "fleet": {"partitions": 2 * consumers, **(fleet or {})},
    }
    data.update(extra)
    return parse_scenario(data)


def run(scenario, variant):
    s = fleet_variant(scenario, variant)
    arrivals = make_arrivals(s)
    outcome = simulate_fleet(s, arrivals)
    return outcome, measure_fleet(s, outcome)


def test_range_assignor_gives_contiguous_blocks_of_equal_count():
    assert range_assignment(5, 2) == [(0, 1, 2), (3, 4)]
    assert range_assignment(8, 4) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert weighted_assignment(4, [1.0, 1 / 3]) == [(0, 1, 2), (3,)]
    assert weighted_assignment(16, [1.0, 1.0, 1.0, 1 / 3]) == [
        tuple(range(5)),
        tuple(range(5, 10)),
        tuple(range(10, 15)),
        (15,),
    ]
    assert [len(b) for b in weighted_assignment(4, [1.0, 1.0, 1.0, 1 / 3])] == [1, 1, 1, 1], "at least one each"
    s = fleet_scenario(consumers=2, fleet={"partitions": 4})
    lanes = make_arrivals(s).lane
    assert set(np.unique(lanes)) == {0, 1}
    assert abs(float((lanes == 0).mean()) - 0.5) < 0.03


def test_hot_partition_sends_its_share_to_its_owner():
    s = fleet_scenario(consumers=4, fleet={"partitions": 8, "hot": {"partition": 0, "share": 0.5}})
    lanes = make_arrivals(s).lane
    # consumer 0 owns partitions 0 and 1: half the keys plus one seventh of the other half
    assert abs(float((lanes == 0).mean()) - (0.5 + 0.5 / 7)) < 0.02


def test_same_seed_same_fleet_run():
    s = fleet_scenario({"slow": {"consumers": [1], "factor": 3.0}})
    a, b = run(s, "on")[0], run(s, "on")[0]
    assert np.array_equal(a.done_ms, b.done_ms)
    assert np.array_equal(a.served_by, b.served_by)


def test_straggler_forwarding_cuts_the_group_p99_and_only_the_slow_one_forwards():
    s = fleet_scenario({"slow": {"consumers": [1], "factor": 3.0}})
    _, off = run(s, "off")
    on_out, on = run(s, "on")
    _, ideal = run(s, "ideal")
    assert off.p99_ms > 5 * ideal.p99_ms  # the straggler holds the group's tail
    assert on.p99_ms < 0.3 * off.p99_ms
    assert off.forwarded_share == 0.0
    assert on_out.forwards_out[0] == 0 and on_out.forwards_out[1] > 0
    assert on.consumers[0].share > on.consumers[1].share  # the fast device carries more


def test_a_hot_partition_on_equal_devices_is_relieved_by_its_cooler_peers():
    """Equal devices, so only the load in the beacons tells the hot consumer from its twins."""
    s = fleet_scenario({"partitions": 8, "hot": {"partition": 0, "share": 0.5}}, consumers=4, rate=1113.0)
    on_out, on = run(s, "on")
    _, off = run(s, "off")
    _, ideal = run(s, "ideal")
    assert off.p99_ms > 5 * ideal.p99_ms  # the hot consumer is overloaded
    assert on.p99_ms < 1.4 * ideal.p99_ms
    assert on_out.forwards_out[0] > 0.9 * on_out.forwards_out.sum(), "the hot consumer hands on, the others keep"


def test_every_request_answered_once_with_forwards_and_deadlines():
    s = fleet_scenario(
        {"slow": {"consumers": [0], "factor": 4.0}}, consumers=3, rate=600.0, duration=6, deadline_ms=400.0
    )
    out, m = run(s, "on")
    n = len(out.arrivals)
    assert not np.isnan(out.done_ms).any()
    assert sum(out.batch_sizes) + int(out.expired.sum()) == n
    served = ~out.expired
    assert np.all((out.served_by[served] >= 0) & (out.served_by[served] < 3))
    assert np.all(out.served_by[out.expired] == -1)
    # a forwarded request leaves its owner once and never comes back through another forward
    assert int(out.forwards_out.sum()) == int(out.forwarded.sum()) == int(out.forwards_in.sum())
    moved = out.forwarded & served
    assert moved.any()
    assert np.all(out.served_by[moved] != out.arrivals.lane[moved])
    assert np.all(out.done_ms[served] >= out.arrivals.create_ms[served])
    assert m.requests == n


def test_equal_consumers_forward_under_one_percent():
    """Issue 24's "no cost when all are equal", at its straggler run's load with both devices fast."""
    s = fleet_scenario(rate=300.0, duration=20)
    _, on = run(s, "on")
    _, off = run(s, "off")
    assert on.forwarded_share < 0.01
    assert on.p99_ms <= 1.05 * off.p99_ms


def test_slowdown_applies_only_inside_its_window():
    s = fleet_scenario({"slowdown": {"consumer": 1, "from_s": 2, "to_s": 4, "factor": 3.0}})
    fleet = s.fleet
    assert fleet.factor(1, 1999.0) == 1.0
    assert fleet.factor(1, 2000.0) == 3.0
    assert fleet.factor(1, 4000.0) == 1.0
    assert fleet.factor(0, 3000.0) == 1.0
    assert fleet.steady_factor(1) == 1.0


@pytest.mark.parametrize(
    "fleet, topology, message",
    [
        ({"partitions": 1}, {}, "range assignor would leave 1 consumer(s) without work"),
        ({"partitions": 4, "assignment": "sticky"}, {}, "not one of ['range', 'capacity']"),
        ({"partitions": 4, "slow": {"consumers": [2], "factor": 3.0}}, {}, "not a consumer index 0..1"),
        ({"partitions": 4, "slow": {"consumers": [1], "factor": 0}}, {}, "factor: must be > 0"),
        (
            {"partitions": 4, "slowdown": {"consumer": 0, "from_s": 5, "to_s": 5, "factor": 3.0}},
            {},
            "to_s (5) must be after from_s (5)",
        ),
        (
            {"partitions": 4, "slowdown": {"consumer": 0, "from_s": 50, "to_s": 60, "factor": 3.0}},
            {},
            "past the end of the run",
        ),
        ({"partitions": 4, "hot": {"partition": 4, "share": 0.5}}, {}, "not a partition 0..3"),
        ({"partitions": 4, "hot": {"share": 1.0}}, {}, "must be > 0 and < 1"),
        ({"partitions": 4, "beacon_ms": 200}, {}, "unknown key 'beacon_ms'"),
        ({"partitions": 4, "forwarding": "yes"}, {}, "expected true or false"),
        ({}, {}, "missing key 'partitions'"),
        ({"partitions": 4}, {"skew": 1.0}, "takes only 'consumers'"),
    ],
)
def test_bad_fleet_tables_name_the_key(fleet, topology, message):
    data = {
        "name": "bad",
        "phases": [{"duration_s": 10, "rate_per_s": 100}],
        "cost": {"a_ms": 20.0, "c_ms": 2.0},
        "topology": {"consumers": 2, **topology},
        "fleet": fleet,
    }
    with pytest.raises(ScenarioError) as e:
        parse_scenario(data, "x.toml")
    assert message in str(e.value)
    assert "x.toml" in str(e.value)


FLEET_TOML = """
name = "tiny-fleet"
seed = 3
[[phases]]
duration_s = 5
rate_per_s = 300
[cost]
a_ms = 20.0
c_ms = 2.0
[topology]
consumers = 2
[fleet]
partitions = 4
slow = { consumers = [1], factor = 3.0 }
"""


def test_bench_fleet_cli_prints_every_run_and_writes_json(tmp_path):
    app = typer.Typer()
    bench.register(app)
    path = tmp_path / "tiny-fleet.toml"
    path.write_text(FLEET_TOML)
    out = tmp_path / "fleet.json"
    result = CliRunner().invoke(app, ["bench", "fleet", str(path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "balance off" in result.output and "balance on" in result.output and "ideal" in result.output
    [report] = json.loads(out.read_text())
    assert set(report["runs"]) == {"off", "on", "weighted", "weighted+on", "ideal"}
    assert report["stragglers"] == [1]
    runs = report["runs"]
    assert report["ratios"]["on_p99_vs_ideal"] == pytest.approx(runs["on"]["p99_ms"] / runs["ideal"]["p99_ms"])
    assert runs["on"]["p99_ms"] < runs["off"]["p99_ms"]
    assert [c["consumer"] for c in runs["on"]["consumers"]] == [0, 1]
    assert sum(c["share"] for c in runs["on"]["consumers"]) == pytest.approx(1.0)

    plain = tmp_path / "plain.toml"
    plain.write_text(FLEET_TOML.split("[topology]")[0])
    refused = CliRunner().invoke(app, ["bench", "fleet", str(plain)])
    assert refused.exit_code == 2 and "no [fleet] table" in refused.output
    other = CliRunner().invoke(app, ["bench", "policies", "--scenario", str(path), "--quick"])
    assert other.exit_code == 2 and "bench fleet" in other.output


def test_policy_suite_leaves_fleet_scenarios_to_bench_fleet(tmp_path):
    from pipeline.tools.bench.policy import scenario_files

    (tmp_path / "a-fleet.toml").write_text(FLEET_TOML)
    (tmp_path / "plain.toml").write_text(FLEET_TOML.split("[topology]")[0])
    assert [p.name for p in scenario_files(tmp_path)] == ["plain.toml"]


def test_shipped_fleet_scenarios_load_and_lay_out_their_groups():
    from pathlib import Path

    from pipeline.core.sim.scenario_file import load_scenario

    root = Path(__file__).resolve().parents[2] / "scenarios"
    files = sorted(root.glob("fleet-*.toml"))
    assert len(files) >= 11
    for path in files:
        s = load_scenario(path)
        assert s.fleet is not None and s.fleet.partitions >= s.topology.consumers
    flapping = load_scenario(root / "fleet-flapping.toml").fleet
    assert flapping is not None and len(flapping.slowdowns) == 6
    assert [flapping.factor(0, t * 1000.0) for t in (1.5, 2.5, 3.5, 7.2)] == [1.0, 4.0, 1.0, 4.0]
    big = load_scenario(root / "fleet-64.toml").fleet
    assert big is not None and [c for c in range(64) if big.steady_factor(c) == 3.0] == [0, 21, 42, 63]
