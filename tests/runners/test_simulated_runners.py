"""Cost-model and zero-cost runners: t(b) timing, labelling, the poison test hook."""

from __future__ import annotations

import time

import pytest

from consumers.runners import make_runner
from consumers.runners.base import Runner
from consumers.runners.cost_model import POISON_MARKER, SIMULATED_TEXT, CostCurve, PoisonError
from pipeline.config import BatchProfile, ModelConfig
from schemas.messages import GenerationParams, Request


def _reqs(n: int, text: str = "hello") -> list[Request]:
    return [Request(id=f"r{i}", model="sim", text=text) for i in range(n)]


def _timed(runner: Runner, reqs: list[Request]) -> float:
    start = time.perf_counter()
    runner.run(reqs)
    return (time.perf_counter() - start) * 1000


def test_curve_interpolates_and_extrapolates_points() -> None:
    curve = CostCurve(((1, 10.0), (8, 24.0), (32, 72.0)), 5.0, 0.5)
    assert curve.ms(1) == pytest.approx(10.0)
    assert curve.ms(4) == pytest.approx(10.0 + 14.0 * 3 / 7)
    assert curve.ms(20) == pytest.approx(48.0)
    assert curve.ms(64) == pytest.approx(136.0)  # last segment extended
    assert CostCurve((), 5.0, 0.5).ms(10) == pytest.approx(10.0)
    assert CostCurve(((10, 20.0),), 0, 0).ms(5) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="repeated"):
        CostCurve(((1, 1.0), (1, 2.0)), 0, 0)


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
        runner = make_runner(ModelConfig(name="sim", runner=kind))  # type: ignore[arg-type]
        outs = runner.run(_reqs(3))
        assert len(outs) == 3
        assert all(o.text == SIMULATED_TEXT and o.embedding == [] for o in outs)
        assert runner.device_memory()[1] == "process_rss"


def test_zero_cost_runner_is_fast() -> None:
    runner = make_runner(ModelConfig(name="sim", runner="zero-cost"))
    reqs = _reqs(64)
    start = time.perf_counter()
    for _ in range(100):
        runner.run(reqs)
    assert (time.perf_counter() - start) / 100 < 0.005


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
