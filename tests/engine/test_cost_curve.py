"""Rule 8: the effective cap from the learned cost curve t(b)."""

from __future__ import annotations

from pipeline.config import BatchProfile
from pipeline.engine import BatchingEngine
from pipeline.engine.costcurve import CostCurve

from tests.engine.helpers import run_saturated


def linear(size: int, _: int) -> float:
    return 5.0 + 0.5 * size


def peaked_at_8(size: int, _: int) -> float:
    """An encoder whose throughput b/t(b) peaks at b=8 and falls after."""
    if size <= 8:
        return 10.0 + 0.2 * size
    return 11.6 + 3.0 * (size - 8)


def test_linear_curve_keeps_the_cap_at_hard_cap() -> None:
    engine = BatchingEngine(BatchProfile(hard_cap=48))
    records = run_saturated(engine, linear, 400)
    assert engine.curve.cap == 48 and engine.curve.reason == "configured"
    regular = [r for r in records if r.cap_reason != "probe"]
    assert all(r.effective_cap == 48 and r.size == 48 for r in regular)
    probes = [r for r in records if r.cap_reason == "probe"]
    assert 0 < len(probes) <= len(records) // 6, "probes are occasional"
    assert all(r.size <= r.effective_cap <= 48 for r in records)


def test_peaked_curve_converges_to_the_peak() -> None:
    engine = BatchingEngine(BatchProfile(hard_cap=48))
    records = run_saturated(engine, peaked_at_8, 600)
    assert engine.curve.cap == 8 and engine.curve.reason == "knee"
    late = records[-100:]
    assert sum(r.size == 8 for r in late) >= 80
    assert all(r.size <= r.effective_cap <= 48 for r in records)


def test_no_shrink_without_evidence_of_larger_sizes() -> None:
    curve = CostCurve(hard_cap=48, knee_tolerance=0.02, budget_ms=None)
    for size in range(1, 9):
        curve.observe(size, peaked_at_8(size, 0))
    assert curve.cap == 48, "throughput still rising at the largest size seen"
    curve.observe(12, peaked_at_8(12, 0))
    assert (curve.cap, curve.reason) == (8, "knee")


def test_plateau_counts_as_a_knee() -> None:
    curve = CostCurve(hard_cap=64, knee_tolerance=0.02, budget_ms=None)
    for size in (1, 2, 4, 8, 16, 32, 64):
        curve.observe(size, 10.0 + size if size <= 16 else 26.0 / 16 * size)
    assert (curve.cap, curve.reason) == (16, "knee")


def test_compute_budget_bounds_the_cap() -> None:
    curve = CostCurve(hard_cap=48, knee_tolerance=0.02, budget_ms=20.0)
    for size in (8, 16, 24, 32, 48):
        curve.observe(size, linear(size, 0))
    assert (curve.cap, curve.reason) == (24, "budget")


def test_default_budget_is_half_the_slo() -> None:
    engine = BatchingEngine(BatchProfile(hard_cap=48, slo_p99_ms=40.0))
    run_saturated(engine, linear, 200)
    assert engine.curve.reason == "budget"
    assert linear(engine.curve.cap, 0) <= 20.0


def test_step_up_shift_adapts_the_cap_and_says_shift() -> None:
    profile = BatchProfile(hard_cap=48, compute_budget_ms=40.0)
    engine = BatchingEngine(profile)

    def heavier_after_300(size: int, index: int) -> float:
        return linear(size, index) * (2.5 if index >= 300 else 1.0)

    records = run_saturated(engine, heavier_after_300, 600)
    assert all(r.effective_cap == 48 for r in records[250:300] if r.cap_reason != "probe")
    shifted = [i for i, r in enumerate(records) if r.cap_reason == "shift"]
    assert shifted and 300 <= shifted[0] <= 305, "detected within a few batches"
    assert engine.curve.shifts == 1
    final = engine.curve.cap
    assert 16 <= final <= 22 and engine.curve.reason == "budget"
    assert 2.5 * linear(final, 0) <= 40.0
    settled = next(i for i in range(300, 600) if records[i].effective_cap <= 22)
    assert settled - 300 <= 40, f"cap moved after {settled - 300} batches"
    assert all(r.size <= r.effective_cap <= 48 for r in records)


def test_adaptive_cap_off_keeps_hard_cap() -> None:
    engine = BatchingEngine(BatchProfile(hard_cap=48, adaptive_cap=False))
    records = run_saturated(engine, peaked_at_8, 200)
    assert all(r.size == 48 and r.cap_reason == "configured" for r in records)
