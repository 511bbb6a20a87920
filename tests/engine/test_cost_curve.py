"""Rule 8: the effective cap from the learned cost curve t(b)."""

from __future__ import annotations

import math
import random

from pipeline.config import BatchProfile
from pipeline.engine import BatchingEngine
from pipeline.engine.costcurve import CostCurve

from tests.engine.helpers import request, run_saturated


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
    assert curve.cap == 12, "one measurement of a worse size: hold there, measure again"
    curve.observe(12, peaked_at_8(12, 0))
    curve.observe(12, peaked_at_8(12, 0))
    assert (curve.cap, curve.reason) == (8, "knee")


def test_noisy_times_are_made_monotone_not_read_as_a_cliff() -> None:
    curve = CostCurve(hard_cap=48, knee_tolerance=0.02, budget_ms=None)
    for _ in range(3):
        curve.observe(1, 16.0)
        curve.observe(2, 9.0)
        curve.observe(3, 9.6)
        curve.observe(24, 40.0)
    times = [t for _, t in curve.points()]
    assert times == sorted(times)
    assert curve.cap == 48


def test_plateau_counts_as_a_knee() -> None:
    curve = CostCurve(hard_cap=64, knee_tolerance=0.02, budget_ms=None)
    for size in (1, 2, 4, 8, 16, 32, 64) * 3:
        curve.observe(size, 10.0 + size if size <= 16 else 26.0 / 16 * size)
    assert (curve.cap, curve.reason) == (16, "knee")


def test_compute_budget_bounds_the_cap() -> None:
    curve = CostCurve(hard_cap=48, knee_tolerance=0.02, budget_ms=20.0)
    for size in (8, 16, 24, 32, 48) * 3:
        curve.observe(size, linear(size, 0))
    # t(b) = 5 + 0.5 b crosses 20 ms at b = 30, between the measured 24 and 32
    assert (curve.cap, curve.reason) == (30, "budget")


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
    assert shifted and 300 <= shifted[0] <= 306, "detected within a few batches"
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


def test_cap_ramp_never_sends_a_hard_cap_batch_to_a_peaked_model() -> None:
    engine = BatchingEngine(BatchProfile(hard_cap=128, target_size=32, cap_ramp=True))
    assert (engine.curve.cap, engine.curve.reason) == (32, "ramp")
    records = run_saturated(engine, peaked_at_8, 800, arrivals_per_batch=140)
    assert max(r.size for r in records) <= 64
    assert engine.curve.cap == 8


def test_cap_ramp_reaches_hard_cap_on_an_affine_model_in_a_few_batches() -> None:
    engine = BatchingEngine(BatchProfile(hard_cap=128, target_size=32, cap_ramp=True))
    records = run_saturated(engine, linear, 40, arrivals_per_batch=140)
    assert [r.size for r in records[:3]] == [32, 64, 128]
    assert engine.curve.cap == 128 and engine.curve.reason == "configured"


def test_noisy_affine_curve_keeps_hard_cap_and_sees_no_shift() -> None:
    """Compute times jitter +-35% (a token mix behind a request-count cap)."""

    def jittery(size: int, index: int) -> float:
        return linear(size, index) * (1.0 + 0.35 * math.sin(index * 2.3))

    engine = BatchingEngine(BatchProfile(hard_cap=48))
    records = run_saturated(engine, jittery, 600)
    assert engine.curve.shifts == 0
    assert engine.curve.cap == 48
    late = [r for r in records[100:] if r.cap_reason != "probe"]
    assert all(r.effective_cap == 48 for r in late)



def _host_noise(count: int, seed: int = 7) -> list[float]:
    """Multiplicative compute-time noise of a heavily loaded host (lognormal, sigma 0.8)."""
    rng = random.Random(seed)
    return [rng.lognormvariate(0.0, 0.8) for _ in range(count)]


def test_noise_on_a_busy_host_is_not_a_shift() -> None:
    """Compute times swinging 2x either way around an affine curve (a loaded CPU)
    are no model change: no shift, and the cap is not dragged down."""
    noise = _host_noise(600)
    engine = BatchingEngine(BatchProfile(target_size=32, hard_cap=48))
    records = run_saturated(engine, lambda size, i: linear(size, i) * noise[i], 600)
    assert engine.curve.shifts == 0
    assert all(r.effective_cap == 48 for r in records[-100:] if r.cap_reason != "probe")


def test_near_free_model_is_not_batched_one_by_one() -> None:
    """Microsecond compute times with heavy relative noise (a zero-cost runner):
    the per-batch overhead outside the device dominates, so the cap stays at hard_cap."""
    noise = _host_noise(600)
    engine = BatchingEngine(BatchProfile(target_size=32, hard_cap=48))
    records = run_saturated(engine, lambda size, i: 0.05 * noise[i] * (1 + size / 48), 600)
    assert all(r.effective_cap == 48 for r in records[-100:])


def test_cap_learned_from_tiny_batches_recovers_fast_under_backlog() -> None:
    """Low load shows only batches of 1-3 with flat per-item cost (the knee looks
    like 1-2); when a backlog arrives and bigger batches pay, the cap must climb
    within tens of batches, not hundreds (up-probes double while far below hard_cap)."""
    engine = BatchingEngine(BatchProfile())
    now = 0.0
    for i in range(300):
        for _ in range(1 + i % 3):
            engine.offer(request(now), now)
        batch = engine.poll(now).batch
        assert batch is not None
        now += 17.0 * batch.size + 30.0
        engine.completed(batch, now, 17.0 * batch.size)
    assert engine.curve.cap <= 3, "premise: the low-load knee is tiny"
    records = run_saturated(engine, lambda size, _: 17.0 if size == 1 else 6.0 + 11.0 * size, 60)
    assert max(r.effective_cap for r in records[-10:]) >= 16
