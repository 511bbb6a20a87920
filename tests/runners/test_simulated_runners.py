"""Cost-model and zero-cost runners: t(b) timing, labelling, the poison test hook."""

from __future__ import annotations

import time

import pytest

from consumers.runners import make_runner
from consumers.runners.base import Runner
from consumers.runners.cost_model import POISON_MARKER, SIMULATED_TEXT, CostModelRunner, PoisonError
from pipeline.core.config import BatchProfile, ModelConfig
from pipeline.core.sim.device_curve import DeviceCurve
from pipeline.core.sim.scenario_file import parse_scenario
from schemas.messages import GenerationParams, Request


def _reqs(n: int, text: str = "hello") -> list[Request]:
    return [Request(id=f"r{i}", model="sim", text=text) for i in range(n)]


def _timed(runner: Runner, reqs: list[Request]) -> float:
    start = time.perf_counter()
    runner.run(reqs)
    return (time.perf_counter() - start) * 1000


def test_curve_interpolates_and_extrapolates_points() -> None:
    curve = DeviceCurve(5.0, 0.5, ((1, 10.0), (8, 24.0), (32, 72.0)))
    assert curve.ms(1) == pytest.approx(10.0)
    assert curve.ms(4) == pytest.approx(10.0 + 14.0 * 3 / 7)
    assert curve.ms(20) == pytest.approx(48.0)
    assert curve.ms(64) == pytest.approx(136.0)  # last segment extended
    assert curve.ms(0.5) == pytest.approx(9.0)  # the first segment continues below it
    assert DeviceCurve(points=((1, 10.0), (2, 50.0))).ms(0.5) == pytest.approx(0.1)  # ... but never below 1%
    assert DeviceCurve(5.0, 0.5).ms(10) == pytest.approx(10.0)
    assert DeviceCurve(points=((10, 20.0),)).ms(5) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="repeated"):
        DeviceCurve(points=((1, 1.0), (1, 2.0)))


def test_the_runner_sleeps_the_simulators_curve() -> None:
    """One simulated device: the runner's t(b) is the curve a scenario with the same points charges."""
    points = ((1, 5.0), (8, 12.0), (32, 60.0))
    runner = make_runner(ModelConfig(name="sim", runner="cost-model", cost_points=points))
    assert isinstance(runner, CostModelRunner)
    simulated = parse_scenario(
        {"name": "t", "phases": [{"duration_s": 1, "rate_per_s": 10}], "cost": {"points": [list(p) for p in points]}},
        "t.toml",
    ).cost
    assert [runner.curve.ms(b) for b in (1, 4, 8, 20, 64)] == [simulated.batch_ms(b, 0, 0.0) for b in (1, 4, 8, 20, 64)]


def test_cost_model_runner_sleeps_t_of_b() -> None:
    runner = make_runner(ModelConfig(name="sim", runner="cost-model", cost_points=((1, 5.0), (32, 60.0))))
    assert runner.simulated
    small = min(_timed(runner, _reqs(1)) for _ in range(3))
    large = min(_timed(runner, _reqs(32)) for _ in range(3))
    assert 5.0 <= small < large
    assert large >= 60.0


def test_tokens_cost_unit_counts_tokens() -> None:
    model = ModelConfig(
        name="sim", runner="cost-model", cost_a_ms=0.0, cost_c_ms=1.0, profile=BatchProfile(cost_unit="tokens")
    )
    runner = make_runner(model)
    reqs = [Request(id="a", model="sim", token_ids=[1] * 10, params=GenerationParams(max_new_tokens=5))]
    assert runner.measure(reqs[0]) == (10, 5)
    assert _timed(runner, reqs) >= 15.0


def test_outputs_are_marked_simulated() -> None:
    for kind in ("cost-model", "zero-cost"):
        runner = make_runner(ModelConfig(name="sim", runner=kind))
        outs = runner.run(_reqs(3))
        assert len(outs) == 3
        assert all(o.text == SIMULATED_TEXT and o.embedding == [] for o in outs)
        assert runner.device_memory()[1] == "process_rss"


def test_zero_cost_runner_is_fast() -> None:
    """Against a baseline in the same test: a batch costing 5 ms on the simulated device. The
    fastest of 20 runs (one a loaded machine did not interrupt) is a small part of it."""
    reqs = _reqs(64)
    zero = make_runner(ModelConfig(name="sim", runner="zero-cost"))
    five_ms = make_runner(ModelConfig(name="sim", runner="cost-model", cost_a_ms=5.0, cost_c_ms=0.0))
    baseline = min(_timed(five_ms, reqs) for _ in range(3))
    fastest = min(_timed(zero, reqs) for _ in range(20))
    assert baseline >= 5.0
    assert fastest < baseline / 5, (fastest, baseline)


def test_check_refuses_overlong_estimated_input() -> None:
    runner = make_runner(ModelConfig(name="sim", runner="zero-cost", max_input_tokens=8))
    assert runner.check(_reqs(1, "x" * 32)[0]) is None
    assert "max_input_tokens" in (runner.check(_reqs(1, "x" * 40)[0]) or "")


def test_poison_hook_is_off_unless_configured() -> None:
    poisoned = [Request(id="p", model="sim", text=f"a {POISON_MARKER} b")]
    assert len(make_runner(ModelConfig(name="sim", runner="zero-cost")).run(poisoned)) == 1
    armed = make_runner(ModelConfig(name="sim", runner="cost-model", cost_a_ms=0, poison_marker=POISON_MARKER))
    with pytest.raises(PoisonError, match="test hook"):
        armed.run(_reqs(2) + poisoned)
