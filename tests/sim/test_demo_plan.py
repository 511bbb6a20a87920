"""The demo's plan: capacity from a calibration's answers, load sized to it, the profile cache key, the verdict."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.config import ModelConfig
from pipeline.core.sim.scenario_file import load_scenario
from pipeline.tools.devtools import demo_plan as plan

ROOT = Path(__file__).resolve().parents[2]


def _point(size: int, ms: float, per_run: int) -> dict:
    return {
        "size": size,
        "tokens": 32 * size,
        "median_ms": ms,
        "p90_ms": ms * 1.1,
        "items_per_s": size * 1000 / ms,
        "tokens_per_s": per_run * 1000 / ms,
        "peak_bytes": 0,
        "runs": 3,
    }


def _encoder() -> dict:
    return {
        "model": "minilm",
        "task": "embed",
        "knee": 8,
        "points": [_point(1, 20.0, 32), _point(8, 80.0, 256), _point(32, 400.0, 1024)],
    }


def _generator() -> dict:
    return {
        "model": "smollm",
        "task": "generate",
        "knee": 8,
        "prefill": [_point(1, 150.0, 32), _point(8, 600.0, 256)],
        "points": [_point(1, 60.0, 1), _point(8, 120.0, 8)],
    }


def test_encoder_capacity_is_the_knee_throughput() -> None:
    cap = plan.capacity(_encoder(), 0)
    assert cap.knee == 8
    assert cap.requests_per_s == pytest.approx(100.0)  # 8 texts in 80 ms
    assert cap.service_ms == 80.0


def test_generation_capacity_pays_prefill_and_every_decode_step() -> None:
    cap = plan.capacity(_generator(), 16)
    assert cap.service_ms == pytest.approx(600.0 + 16 * 120.0)
    assert cap.requests_per_s == pytest.approx(8 * 1000 / 2520.0)
    assert cap.tokens_per_s == pytest.approx(cap.requests_per_s * 16)
    assert plan.capacity(_generator(), 32).requests_per_s < cap.requests_per_s


def test_a_knee_between_measured_sizes_falls_back_to_the_size_below() -> None:
    profile = {**_encoder(), "knee": 16}
    assert plan.capacity(profile, 0).knee == 8


def test_the_busiest_phase_runs_at_load_times_the_measured_capacity() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "demo.toml")
    scale = plan.multiplier(scenario, capacity_per_s=80.0, load=0.6)
    assert plan.busiest_rate(scenario) * scale == pytest.approx(48.0)
    burst = max(p.bursts.rate_per_s for p in scenario.phases if p.bursts)
    assert burst * scale > 48.0, "bursts go past the busy rate"
    quiet = min(p.rate_per_s for p in scenario.phases)
    assert quiet * scale < 48.0


def test_a_load_under_half_the_measured_capacity_is_refused() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "demo.toml")
    assert plan.busiest_rate(scenario) * plan.multiplier(scenario, 80.0, plan.LOAD_MIN) == pytest.approx(40.0)
    with pytest.raises(ValueError, match=r"at least 0\.5"):
        plan.multiplier(scenario, 80.0, 0.3)


def test_the_sized_load_follows_the_scale() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "demo.toml")
    small = plan.sized_load(scenario, plan.multiplier(scenario, 60.0, 0.6))
    large = plan.sized_load(scenario, plan.multiplier(scenario, 120.0, 0.6))
    expected = sum(rate * (e - s) / 1000 for s, e, rate in scenario.segments())
    for load, capacity in ((small, 60.0), (large, 120.0)):
        scale = plan.multiplier(scenario, capacity, 0.6)
        assert len(load) == pytest.approx(expected * scale, rel=0.1)
    assert small.new_tokens is None and int(small.tokens.min()) >= 12


def test_a_generation_load_sends_its_fixed_output_as_max_new_tokens() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "demo-llm.toml")
    load = plan.sized_load(scenario, 2.0)
    assert load.new_tokens is not None and set(load.new_tokens.tolist()) == {16}
    assert int(load.tokens.max()) <= 48 and int(load.tokens.min()) >= 16, "prompt only, output not counted in"
    assert np.all(np.diff(load.send_ms) >= 0)


def test_what_a_model_served_is_the_rate_of_its_answers_in_the_window() -> None:
    steady = [float(t) for t in range(0, 20_000, 100)]  # one answer every 100 ms
    assert plan.served_per_s(steady, 5_000.0, 15_000.0) == pytest.approx(10.0, rel=0.02)
    assert plan.served_per_s(steady, 30_000.0, 40_000.0) == 0.0, "no answer in the window"
    with pytest.raises(ValueError):
        plan.served_per_s(steady, 5_000.0, 5_000.0)


def test_a_decode_loop_answering_in_waves_is_read_at_the_rate_of_its_waves() -> None:
    """8 rows end together every 2 s: 4 answers/s. Counted over a window that holds three waves
    but only 5 s, the rate would read 4.8/s; the slope through the waves reads 4."""
    waves = [float(t) for t in (1_000, 3_000, 5_000, 7_000) for _ in range(8)]
    assert 24 / 5 == pytest.approx(4.8)
    assert plan.served_per_s(waves, 500.0, 5_500.0) == pytest.approx(4.0, rel=0.01)
    one_wave = [3_000.0] * 8
    assert plan.served_per_s(one_wave, 0.0, 10_000.0) == pytest.approx(0.8), "one wave: counted over the window"


def test_a_calibration_client_may_hold_two_of_the_largest_batch_or_the_recommended_running_set() -> None:
    assert plan.most_in_flight(_encoder()) == 64, "two of the largest profiled batch, 32"
    generator = {**_generator(), "recommended": {"max_inflight_batches": 40}}
    assert plan.most_in_flight(generator) == 40
    assert plan.most_in_flight(_generator()) == 16, "no recommendation: two of the knee's rows"


def test_a_share_of_the_cpu_over_the_limit_fails_and_says_the_machine_was_busy() -> None:
    quiet = plan.busy_check("ran its load", 0.02, 0.03, plan.BUSY_MAX)
    assert quiet.passed and quiet.detail.startswith("3% of its CPU went to other processes in the busiest 10 s")
    busy = plan.busy_check("ran its load", 0.41, 0.43, plan.BUSY_MAX)
    assert not busy.passed
    assert busy.detail == (
        "the machine was busy: 43% of its CPU went to other processes in the busiest 10 s "
        "(41% over the whole; at most 20%)"
    )
    assert plan.busy_check("calibrated", 0.1, plan.BUSY_MAX, plan.BUSY_MAX).passed, "the limit itself is allowed"


def test_a_short_busy_spell_fails_a_window_whose_whole_share_is_low() -> None:
    """Ten busy seconds in a minute fill a p99 with late answers; over the minute they are 9%."""
    spell = plan.busy_check("ran its load", 0.09, 0.55, plan.BUSY_MAX)
    assert not spell.passed and "55%" in spell.detail and "9% over the whole" in spell.detail


def test_the_cache_key_changes_with_what_the_measurement_depends_on() -> None:
    model = ModelConfig(name="minilm", torch_threads=1)
    key = plan.cache_key(model, "Xeon|2|x86_64")
    assert key == plan.cache_key(model, "Xeon|2|x86_64") and key.startswith("minilm-")
    assert key != plan.cache_key(dataclasses.replace(model, torch_threads=2), "Xeon|2|x86_64")
    assert key != plan.cache_key(model, "Xeon|4|x86_64")
    assert key != plan.cache_key(dataclasses.replace(model, model_path="other"), "Xeon|2|x86_64")
    assert "|" in plan.machine_fingerprint()


def _slo(model: str, ratio: float, base: float = 1000.0, per_token: float = 0.0) -> dict:
    return {"model": model, "slo_p99_ms": base, "slo_ms_per_new_token": per_token, "p99_over_slo": ratio}


def test_the_verdict_checks_each_goal_per_model() -> None:
    row = {"model": "minilm", "e2e_p99_ms": 400.0, "share_wait_over_1s": 0.001, "marked_share": 0.02}
    checks = plan.verdict([row], [_slo("minilm", 0.4)], {"minilm": (100, 100)}, {"minilm": {}})
    assert [c.passed for c in checks] == [True, True, True, True, True]
    assert checks[2].detail == "p99 400 ms, 0.40 x the objective (1,000 ms)"
    slow = {**row, "e2e_p99_ms": 1500.0, "marked_share": 0.2}
    failed = [c.name for c in plan.verdict([slow], [_slo("minilm", 1.5)], {"minilm": (99, 100)}) if not c.passed]
    assert failed == [
        "minilm: every request answered",
        "minilm: e2e p99 within its objective",
        "minilm: tail-marked under 10%",
    ]
    missing = plan.verdict([], [], {"smollm": (10, 10)})
    assert [c.name for c in missing if not c.passed] == ["smollm: in the report"]


def test_a_generated_answer_is_judged_by_its_own_objective() -> None:
    """The report's SLO rows judge each request by slo_p99_ms + its generated tokens x the per-token
    part: the verdict reads their p99 ratio, not the p99 against the base alone."""
    row = {"model": "smollm", "e2e_p99_ms": 4200.0, "share_wait_over_1s": 0.0, "marked_share": 0.0}
    (latency,) = [
        c for c in plan.verdict([row], [_slo("smollm", 0.84, 1000.0, 250.0)], {"smollm": (50, 50)}) if "p99" in c.name
    ]
    assert latency.passed
    assert latency.detail == "p99 4,200 ms, 0.84 x the objective (1,000 ms + 250 ms per generated token)"


def test_a_busy_machine_fails_a_run_that_met_every_objective() -> None:
    """A calibration beside a CPU hog measures the hog's leftovers and sizes the load down to them:
    every objective is met, and the verdict still fails, saying why."""
    row = {"model": "minilm", "e2e_p99_ms": 300.0, "share_wait_over_1s": 0.0, "marked_share": 0.0}
    busy = [plan.busy_check("calibrated", 0.46, 0.48, 0.2), plan.busy_check("ran its load", 0.45, 0.47, 0.2)]
    checks = plan.verdict([row], [_slo("minilm", 0.3)], {"minilm": (900, 900)}, {"minilm": {}}, busy)
    failed = [c for c in checks if not c.passed]
    assert [c.name for c in failed] == [
        "machine not busy while the demo calibrated",
        "machine not busy while the demo ran its load",
    ]
    assert all(c.detail.startswith("the machine was busy: 4") for c in failed)


def test_a_refused_request_of_the_load_fails_the_verdict_and_is_named_by_reason() -> None:
    """The issue's demo: 49 of 49 answered, 5 of them refused, and every other goal met."""
    row = {"model": "smollm", "e2e_p99_ms": 400.0, "share_wait_over_1s": 0.0, "marked_share": 0.0}
    answers: dict[str, tuple[str, str | None]] = {f"r{i}": ("ok", None) for i in range(44)}
    answers |= {f"x{i}": ("rejected", f"input_too_long: request needs {60 + i} tokens") for i in range(5)}
    not_ok = plan.not_ok_by_reason(answers)
    assert not_ok == {"rejected: input_too_long": 5}
    checks = plan.verdict([row], [_slo("smollm", 0.1)], {"smollm": (49, 49)}, {"smollm": not_ok})
    assert [c.name for c in checks if not c.passed] == ["smollm: none refused or failed"]
    (refused,) = [c for c in checks if not c.passed]
    assert refused.detail == "5 rejected: input_too_long"
    failed = {
        "a": ("error", "the answer (900 bytes) is larger than max.message.bytes (700) of topic t"),
        "b": ("error", "CUDA error"),
        "c": ("expired", "deadline passed"),
        "d": ("rejected", "schema: id"),
        "e": ("ok", None),
    }
    assert plan.not_ok_by_reason(failed) == {
        "error: oversize": 1,
        "error: runner_error": 1,
        "expired: deadline": 1,
        "rejected: schema": 1,
    }


def test_the_speed_seen_weighs_each_profiled_size_by_its_batches() -> None:
    rows = [
        {"size": 1, "batches": 30, "compute_p50_ms": 40.0},
        {"size": 8, "batches": 10, "compute_p50_ms": 80.0},
        {"size": 3, "batches": 99, "compute_p50_ms": 50.0},
    ]
    seen = plan.speed_seen(_encoder(), rows)
    assert seen is not None
    ratio, batches = seen
    assert batches == 40, "size 3 was not profiled"
    assert ratio == pytest.approx((0.5 * 30 + 1.0 * 10) / 40)
    assert plan.speed_seen(_encoder(), rows[2:]) is None
    assert plan.speed_seen(_generator(), rows) is None


def test_the_demo_config_carries_the_objectives_and_what_the_profiles_sized(tmp_path: Path) -> None:
    from pipeline.core.config import load_config
    from pipeline.tools.commands.demo import MINILM, SMOLLM, _write_config

    path = tmp_path / "batchtide.toml"
    sized: dict[str, dict[str, float]] = {"smollm": {"hard_cap": 96, "target_size": 48, "max_inflight_batches": 16}}
    _write_config(path, "127.0.0.1:9999", tmp_path, 1, sized)
    cfg = load_config(path)
    llm, encoder = cfg.model("smollm"), cfg.model("minilm")
    assert (llm.task, llm.batching, llm.isolation, llm.max_new_tokens) == ("generate", "iteration", "thread", 16)
    assert (llm.profile.hard_cap, llm.profile.target_size, llm.profile.max_inflight_batches) == (96, 48, 16)
    assert llm.profile.cost_unit == "tokens"
    for model, spec in ((SMOLLM, llm), (MINILM, encoder)):
        assert model.objective_ms == spec.profile.slo_p99_ms + spec.max_new_tokens * spec.profile.slo_ms_per_new_token
    assert encoder.profile.hard_cap == "auto" and encoder.torch_threads == 1
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:9999"


def test_a_cached_profile_for_this_set_up_is_reused(tmp_path: Path) -> None:
    import json

    from pipeline.core.config import load_config
    from pipeline.tools.commands.demo import MINILM, _profile, _write_config

    config = tmp_path / "batchtide.toml"
    _write_config(config, "127.0.0.1:9999", tmp_path, 1, {})
    key = plan.cache_key(load_config(config).model("minilm"), plan.machine_fingerprint())
    cached = tmp_path / "cache" / f"{key}.json"
    cached.parent.mkdir()
    from pipeline.core.profile_file import REVISION

    profile = {"format": "batchtide-profile/1", **_encoder()}
    profile["recommended"] = {**profile.get("recommended", {}), "revision": REVISION}
    cached.write_text(json.dumps(profile))
    assert _profile(MINILM, config, tmp_path / "cache", False, {}, tmp_path / "profile.log") == (cached, True)
    assert not (tmp_path / "profile.log").exists(), "nothing was measured"


def test_the_demo_refuses_a_load_under_half_the_measured_capacity(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, ["demo", "--llm-load", "0.3", "--workdir", str(tmp_path / "demo")])
    assert result.exit_code == 2 and "at least 0.5" in result.output
    assert not (tmp_path / "demo").exists()


def test_the_ramp_repeats_the_busiest_phase_with_its_bursts_at_rising_rates() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "demo.toml")
    ramp = plan.ramp(scenario, top_per_s=80.0, shares=(0.5, 1.0), step_s=12.0)
    assert [phase.rate_per_s for phase in ramp.phases] == pytest.approx([40.0, 80.0])
    assert [phase.duration_s for phase in ramp.phases] == [12.0, 12.0]
    busiest = max(scenario.phases, key=lambda phase: phase.rate_per_s)
    assert busiest.bursts is not None
    for phase in ramp.phases:
        assert phase.bursts is not None
        assert phase.bursts.rate_per_s / phase.rate_per_s == pytest.approx(
            busiest.bursts.rate_per_s / busiest.rate_per_s
        )
        assert phase.bursts.every_s == busiest.bursts.every_s
    sent = plan.sized_load(ramp, 1.0).send_ms
    first, second = int((sent < 12_000).sum()), int((sent >= 12_000).sum())
    assert second == pytest.approx(2 * first, rel=0.25), "the second step sends twice the first's requests"
    with pytest.raises(ValueError):
        plan.ramp(scenario, top_per_s=0.0)


def test_a_step_p99_is_over_the_requests_it_sent_and_an_unanswered_one_is_infinitely_late() -> None:
    send = np.array([float(t) for t in range(0, 24_000, 100)])  # 120 requests a step of 12 s
    latency = np.full(len(send), 50.0)
    latency[130] = 900.0  # one slow request in the second step: under 1% of 120 is one request
    latency[131] = 800.0
    assert plan.step_p99s(send, latency, 12.0, 2) == [50.0, 800.0]
    latency[5] = np.inf
    assert plan.step_p99s(send, latency, 12.0, 3) == [50.0, 800.0, 0.0], "one unanswered in 120 is the 1%"
    latency[6] = np.inf
    assert plan.step_p99s(send, latency, 12.0, 1) == [np.inf]


def test_the_steps_met_stop_at_the_first_miss() -> None:
    bars = [1000.0] * 4
    assert plan.steps_met([100.0, 300.0, 900.0, 1500.0], bars) == 3
    assert plan.steps_met([100.0, 1100.0, 900.0, 800.0], bars) == 1, "a pass after a miss is the backlog's luck"
    assert plan.steps_met([1200.0, 300.0, 900.0, 800.0], bars) == 0
    assert plan.steps_met([100.0, 200.0, 300.0, 400.0], bars) == 4


def test_a_step_too_thin_for_a_p99_must_leave_room_under_the_objective() -> None:
    """A generating model's step of a handful of requests is judged by its slowest: at 0.97 x the objective
    that is luck, not room for a load of several times as many answers."""
    send = np.concatenate([np.arange(0.0, 12_000.0, 100.0), np.arange(12_000.0, 24_000.0, 2_000.0)])
    sizes = plan.step_sizes(send, 12.0, 3)
    assert sizes == [120, 6, 0]
    bars = plan.step_bars(sizes, 5000.0)
    assert bars == [5000.0, 5000.0 * plan.THIN_STEP_ROOM, 5000.0 * plan.THIN_STEP_ROOM]
    assert plan.steps_met([4900.0, 4850.0, 0.0], bars) == 1, "the thin step at 0.97 x is not met"
    assert plan.steps_met([4900.0, 0.7 * 5000.0, 0.0], bars) == 3


def test_the_ramp_text_stars_thin_steps_and_names_their_bar_once() -> None:
    text = plan.ramp_text([0.3, 0.5], [1552.0, 4200.0], [4000.0, 4000.0], 5000.0)
    assert text == (
        "p99 ms per step (0.30/s: 1,552*, 0.50/s: 4,200*); within 5,000 ms, * under 100 requests: "
        "within 4,000 ms; met up to step 1 of 2"
    )
    full = plan.ramp_text([10.0, 20.0], [80.0, 1200.0], [1000.0, 1000.0], 1000.0)
    assert full == "p99 ms per step (10.00/s: 80, 20.00/s: 1,200); within 1,000 ms; met up to step 1 of 2"


def test_the_capacity_is_each_models_rate_at_the_highest_step_every_model_met() -> None:
    """Both models ramp on one machine: past the step where the encoder missed, the generator's p99 measured
    the encoder's backlog, so both take the step before it."""
    rates = {"minilm": [20.0, 30.0, 40.0, 50.0], "smollm": [0.5, 0.75, 1.0, 1.25]}
    bars = {"minilm": [1000.0] * 4, "smollm": [5000.0] * 4}
    p99s = {"minilm": [250.0, 500.0, 2400.0, 4800.0], "smollm": [3000.0, 3500.0, 4000.0, 4900.0]}
    assert plan.capacities(rates, p99s, bars) == {"minilm": 30.0, "smollm": 0.75}
    p99s["smollm"] = [3000.0, 5400.0, 4000.0, 4900.0]
    assert plan.capacities(rates, p99s, bars) == {"minilm": 20.0, "smollm": 0.5}
    p99s["smollm"] = [5200.0, 3000.0, 3000.0, 3000.0]
    assert plan.capacities(rates, p99s, bars) == {"minilm": 0.0, "smollm": 0.0}
    alone = {"minilm": rates["minilm"]}
    assert plan.capacities(alone, {"minilm": [250.0, 500.0, 900.0, 999.0]}, bars) == {"minilm": 50.0}


def test_a_load_at_half_the_ramps_capacity_is_half_the_rate_that_met_the_objective() -> None:
    """A virtual pair whose open-loop p99 crosses the objective between 60% and 80% of what it served kept
    busy: the capacity is the 60% step, and the busiest phase of the load runs at half of it."""
    scenario = load_scenario(ROOT / "scenarios" / "demo-llm.toml")
    kept_busy = 2.5
    rates = [share * kept_busy for share in plan.RAMP_SHARES]
    p99s = [2000.0 + 8000.0 * (rate / kept_busy - 0.3) for rate in rates]  # 800, 1,600, 2,800, 4,400, 6,000, 7,600
    capacity = plan.capacities({"smollm": rates}, {"smollm": p99s}, {"smollm": [5000.0] * len(rates)})["smollm"]
    assert capacity == pytest.approx(0.6 * kept_busy)
    scale = plan.multiplier(scenario, capacity, plan.LOAD_MIN)
    assert plan.busiest_rate(scenario) * scale == pytest.approx(0.3 * kept_busy)
