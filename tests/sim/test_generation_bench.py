"""The generation bench: LLM servers' schedulers on the simulated device, and goodput."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.sim.generation.cost import GenerationCost
from pipeline.core.sim.generation.decode_loop import GenArrivals
from pipeline.core.sim.generation.gen_scenario import gen_arrivals, load_gen_scenario, parse_gen_scenario
from pipeline.core.sim.generation.peer_schedulers import TGI, VLLM, FixedWindowGen, SGLang, simulate_tokens
from pipeline.core.sim.scenario import ScenarioError
from pipeline.tools.bench.generation import GenWorkload, bench_scenario, default_layout, figures, run_default

ROOT = Path(__file__).resolve().parents[2]
COST = GenerationCost.linear(10.0, 0.1, 20.0, 0.2)
SMALL: dict[str, Any] = {
    "name": "small",
    "seed": 3,
    "phases": [{"duration_s": 8, "rate_per_s": 4}],
    "tokens": {
        "prompt": {"dist": "lognormal", "median": 200, "sigma": 1.0, "min": 20, "max": 2000},
        "output": {"dist": "lognormal", "median": 40, "sigma": 0.8, "min": 10, "max": 200},
    },
    "generation": {
        "ttft_ms": 1500,
        "tpot_ms": 60,
        "max_new_tokens": 200,
        "kv_tokens": 40000,
        "prefill": {"a_ms": 10.0, "c_ms": 0.12},
        "step": {"a_ms": 20.0, "c_ms": 0.15},
    },
}


def one(prompt: int, emits: int, at: float = 0.0, limit: int = 64) -> GenArrivals:
    return GenArrivals(
        np.array([at]),
        np.array([at]),
        np.array([prompt]),
        np.array([emits]),
        np.array([limit]),
        np.zeros(1, dtype=int),
        np.zeros(1, dtype=int),
        np.array([np.nan]),
    )


@pytest.mark.parametrize("scheduler", [VLLM(), VLLM(chunked=False), TGI(), SGLang(), FixedWindowGen(window_ms=0.0)])
def test_every_scheduler_serves_a_lone_request_as_a_prefill_and_its_steps(scheduler) -> None:
    out = simulate_tokens(one(100, 8), COST, scheduler)
    assert out.first_ms[0] == pytest.approx(10.0 + 0.1 * 100, rel=0.05)
    assert out.done_ms[0] - out.first_ms[0] == pytest.approx(7 * 20.2, rel=0.1)


def test_tgi_waits_for_enough_joiners_unless_it_waited_max_waiting_tokens() -> None:
    create = np.array([0.0, 0.0, 100.0])
    arr = GenArrivals(
        create,
        create.copy(),
        np.array([32, 32, 32]),
        np.array([60, 60, 5]),
        np.full(3, 64),
        np.zeros(3, dtype=int),
        np.zeros(3, dtype=int),
        np.full(3, np.nan),
    )
    patient = simulate_tokens(arr, COST, TGI(waiting_served_ratio=1.2, max_waiting_tokens=20))
    eager = simulate_tokens(arr, COST, TGI(waiting_served_ratio=0.3, max_waiting_tokens=20))
    assert patient.first_ms[2] - 100.0 > 15 * 20.0  # waited ~20 steps for company
    assert eager.first_ms[2] - 100.0 < 3 * 25.0


def test_vllm_preempts_the_newest_row_when_the_kv_cache_runs_out() -> None:
    create = np.array([0.0, 1.0])
    arr = GenArrivals(
        create,
        create.copy(),
        np.array([100, 100]),
        np.array([100, 100]),
        np.full(2, 100),
        np.zeros(2, dtype=int),
        np.zeros(2, dtype=int),
        np.full(2, np.nan),
    )
    out = simulate_tokens(arr, COST, VLLM(kv_tokens=320))
    assert not np.isnan(out.done_ms).any()
    assert out.done_ms[0] < out.done_ms[1]


def test_goodput_counts_requests_meeting_both_objectives() -> None:
    scn = GenWorkload.of_scenario(parse_gen_scenario(SMALL, "small.toml"))
    arr = scn.arrivals
    assert arr.prompt.min() >= 20 and arr.prompt.max() <= 2000 and arr.emits.max() <= 200
    fig = figures(scn, simulate_tokens(arr, scn.cost, VLLM(kv_tokens=scn.kv_tokens)))
    assert 0 < fig["goodput_rps"] <= fig["throughput_rps"]
    assert 0 < fig["attained"] <= 1


def test_batchtide_default_uses_the_profile_layout() -> None:
    scn = GenWorkload.of_scenario(parse_gen_scenario(SMALL, "small.toml"))
    profile, loop, cap, _ = default_layout(scn)
    assert cap == 2000 + 200 and profile.target_size == 32 + 200
    assert loop.token_cap is not None and loop.token_cap <= scn.kv_tokens
    out = run_default(scn, scn.arrivals)
    assert not np.isnan(out.done_ms).any()


def test_bench_reports_every_family_at_its_best() -> None:
    report = bench_scenario(parse_gen_scenario(SMALL, "small.toml"), quick=True)
    systems = [r["system"] for r in report["rows"]]
    assert systems == ["batchtide-default", "vllm (oracle)", "tgi (oracle)", "sglang (oracle)", "fixed-window (oracle)"]
    assert report["default_vs_best_peer"] > 0


def test_shipped_generation_scenarios_load_and_a_bad_one_names_its_key() -> None:
    for path in sorted((ROOT / "scenarios" / "generation").glob("*.toml")):
        assert load_gen_scenario(path).kv_tokens > 0
    bad = {**SMALL, "generation": {**SMALL["generation"], "tpot": 5}}
    with pytest.raises(ScenarioError, match="tpot"):
        parse_gen_scenario(bad, "bad.toml")


def test_cli_prints_the_goodput_table(tmp_path: Path) -> None:
    path = tmp_path / "small.toml"
    path.write_text(
        'name = "small"\nseed = 3\n[[phases]]\nduration_s = 8\nrate_per_s = 4\n[tokens]\n'
        'prompt = { dist = "lognormal", median = 200, sigma = 1.0, min = 20, max = 2000 }\n'
        'output = { dist = "lognormal", median = 40, sigma = 0.8, min = 10, max = 200 }\n'
        "[generation]\nttft_ms = 1500\ntpot_ms = 60\nmax_new_tokens = 200\nkv_tokens = 40000\n"
        "prefill = { a_ms = 10.0, c_ms = 0.12 }\nstep = { a_ms = 20.0, c_ms = 0.15 }\n"
    )
    result = CliRunner().invoke(
        app, ["bench", "generation", "--quick", "-s", str(path), "--json", str(tmp_path / "r.json")]
    )
    assert result.exit_code == 0, result.output
    assert "batchtide-default / best peer goodput" in result.output


@pytest.mark.parametrize("scheduler", [VLLM(), TGI(), SGLang(), FixedWindowGen()])
def test_overload_with_deadlines_answers_everyone(scheduler) -> None:
    scn = parse_gen_scenario({**SMALL, "deadline_ms": 800.0, "phases": [{"duration_s": 4, "rate_per_s": 40}]}, "d.toml")
    out = simulate_tokens(gen_arrivals(scn), scn.cost, scheduler)
    assert not np.isnan(out.done_ms).any() and out.expired.any()


def test_chunked_prefill_keeps_running_rows_decoding_through_a_long_prompt() -> None:
    """A 2,000-token prompt arriving among running rows: prefilled whole, it stalls them for its
    full prefill; cut into 256-token chunks beside their steps, the longest gap between two of their
    tokens is a step and one chunk."""
    n = 9
    create = np.array([0.0] * 8 + [200.0])
    arr = GenArrivals(
        create,
        create.copy(),
        np.array([32] * 8 + [2000]),
        np.array([40] * 8 + [4]),
        np.full(n, 64),
        np.zeros(n, dtype=int),
        np.zeros(n, dtype=int),
        np.full(n, np.nan),
    )
    cost = GenerationCost.linear(10.0, 0.5, 20.0, 0.2)
    whole = simulate_tokens(arr, cost, VLLM(chunked=False, max_num_batched_tokens=4096))
    chunked = simulate_tokens(arr, cost, VLLM(chunked=True, max_num_batched_tokens=256))
    assert whole.longest_gap_ms >= 0.5 * 2000
    assert chunked.longest_gap_ms < 0.2 * whole.longest_gap_ms


def test_the_peers_ride_at_the_price_batchtide_s_loop_pays_on_the_device() -> None:
    """On a device with a ride price (a profile's: a fixed part and a part per token), a chunk fused with
    a decode step costs every scheduler what a ride costs batchtide's loop; on a hand-written curve,
    RIDE_SHARE of the step per chunk for everyone."""
    import dataclasses

    from pipeline.core.sim.generation.chunks import ride_ms, rides
    from pipeline.core.sim.generation.decode_loop import STEP_TOKEN_BUDGET
    from pipeline.core.sim.generation.peer_schedulers import Row, iteration_ms

    curve = GenerationCost.linear(40.0, 2.0, 50.0, 5.0)
    priced = dataclasses.replace(curve, ride_ms_per_token=2.0, ride_fixed_ms=40.0)
    rows = [Row(0, 0.0, 32, 16, 1), Row(1, 0.0, 32, 16, 1)]
    chunk = [(Row(2, 0.0, 500, 16, 1), 100)]
    step = curve.step_ms(2, max(r.kv for r in rows))
    assert iteration_ms(priced, chunk, rows, padded=False) == pytest.approx(step + 40.0 + 100 * 2.0)
    plain = iteration_ms(curve, chunk, rows, padded=False)
    assert plain == pytest.approx(ride_ms(step, rides(100, STEP_TOKEN_BUDGET, 2)))
    assert iteration_ms(priced, chunk, [], padded=False) == pytest.approx(curve.prefill_ms(1, 100))  # alone: a prefill


def test_cli_counts_ttft_misses_with_the_early_give_up_on_and_off(tmp_path: Path) -> None:
    """A load where batchtide-default gives some first tokens up: the report counts them and the late ones
    per row, in the table and the JSON, and `--give-up both` adds the row with the give-up off."""
    busy = {
        **SMALL,
        "phases": [{"duration_s": 8, "rate_per_s": 16}],
        "generation": {**SMALL["generation"], "ttft_ms": 600},
    }
    scn = GenWorkload.of_scenario(parse_gen_scenario(busy, "busy.toml"))
    path = tmp_path / "busy.toml"
    path.write_text(
        'name = "busy"\nseed = 3\n[[phases]]\nduration_s = 8\nrate_per_s = 16\n[tokens]\n'
        'prompt = { dist = "lognormal", median = 200, sigma = 1.0, min = 20, max = 2000 }\n'
        'output = { dist = "lognormal", median = 40, sigma = 0.8, min = 10, max = 200 }\n'
        "[generation]\nttft_ms = 600\ntpot_ms = 60\nmax_new_tokens = 200\nkv_tokens = 40000\n"
        "prefill = { a_ms = 10.0, c_ms = 0.12 }\nstep = { a_ms = 20.0, c_ms = 0.15 }\n"
    )
    out = tmp_path / "r.json"
    args = ["bench", "generation", "--quick", "-s", str(path), "--peers", "vllm", "--json", str(out)]
    result = CliRunner().invoke(app, [*args, "--give-up", "both"])
    assert result.exit_code == 0, result.output
    assert "TTFT late" in result.output and "given up" in result.output
    (report,) = json.loads(out.read_text())
    on, off, peer = report["rows"]
    assert (on["system"], off["system"], peer["system"]) == (
        "batchtide-default",
        "batchtide-default, give-up off",
        "vllm (oracle)",
    )
    for row, give_up in ((on, True), (off, False)):
        outcome = run_default(scn, scn.arrivals, give_up)
        served = ~outcome.expired & ~np.isnan(outcome.done_ms)
        late = served & (outcome.first_ms - outcome.arrivals.create_ms > 600)
        assert (row["ttft_late"], row["given_up"]) == (int(late.sum()), int(outcome.expired.sum()))
    assert on["given_up"] > 0 and off["given_up"] == 0 and off["ttft_late"] > 0
    assert report["default_vs_best_peer"] == pytest.approx(on["goodput_rps"] / peer["goodput_rps"])
    result = CliRunner().invoke(app, [*args, "--give-up", "off"])
    assert result.exit_code == 0, result.output
    assert [r["system"] for r in json.loads(out.read_text())[0]["rows"]] == [off["system"], peer["system"]]
    bad = CliRunner().invoke(app, [*args, "--give-up", "sometimes"])
    assert bad.exit_code == 2 and "--give-up must be on, off or both" in bad.output
