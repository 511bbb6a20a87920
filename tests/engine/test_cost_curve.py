"""Rule 8: the effective cap from the learned cost curve t(b)."""

from __future__ import annotations

import math
import random

from pipeline.core.config import BatchProfile
from pipeline.core.engine import BatchingEngine
from pipeline.core.engine.costcurve import CostCurve
from pipeline.core.engine.decisions import Batch
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


def test_past_a_known_peak_up_probes_step_one_size_not_to_twice_the_knee() -> None:
    """Once sizes above the knee were measured and lost, a probe at 2 x the knee
    (t = 3.3 x t(knee) here) would add most of its compute to the tail of its
    batch: up-probes walk the unmeasured sizes nearest the cap instead, then
    re-check a third above it."""
    engine = BatchingEngine(BatchProfile(hard_cap=48))
    records = run_saturated(engine, peaked_at_8, 600)
    assert engine.curve.cap == 8
    settled = next(i for i, r in enumerate(records) if r.cap_reason == "knee" and r.effective_cap == 8)
    above = [r.size for r in records[settled:] if r.cap_reason == "probe" and r.size > 8]
    assert above, "the cap is still re-checked from above"
    assert max(above) < 16, f"a probe at twice the knee: {above}"
    assert above[-2:] == [11, 11], "all sizes near the cap known: re-checked a third above"


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


def test_compute_budget_bounds_the_latency_cap_not_the_throughput_cap() -> None:
    curve = CostCurve(hard_cap=48, knee_tolerance=0.02, budget_ms=20.0)
    for size in (8, 16, 24, 32, 48) * 3:
        curve.observe(size, linear(size, 0))
    # t(b) = 5 + 0.5 b crosses 20 ms at b = 30, between the measured 24 and 32
    assert (curve.latency_cap, curve.latency_reason) == (30, "budget")
    assert (curve.cap, curve.reason) == (48, "configured"), "a backlog is still served at the knee"


def test_default_budget_is_half_the_slo_and_shapes_only_short_queues() -> None:
    engine = BatchingEngine(BatchProfile(hard_cap=48, slo_p99_ms=40.0))
    records = run_saturated(engine, linear, 200)
    assert engine.curve.latency_reason == "budget"
    assert 29 <= engine.curve.latency_cap <= 31, "t(b) = 5 + 0.5 b crosses 20 ms near b = 30"
    assert all(r.size == 48 for r in records[-20:] if r.cap_reason != "probe"), "backlog: throughput"
    now = 10_000.0
    while engine.pending < 20:
        engine.offer(request(now), now)
    short = engine.poll(now).batch
    assert short is not None and short.size == 20, "a short queue fits the budget: all of it goes"
    engine.completed(short, now + linear(20, 0), linear(20, 0))
    for _ in range(engine.curve.latency_cap):
        engine.offer(request(now), now)
    at_budget = engine.poll(now + 10.0).batch
    assert at_budget is not None and at_budget.record.cap_reason == "budget"
    assert at_budget.size == engine.curve.latency_cap


def test_deadline_shorter_than_the_slo_sets_the_budget() -> None:
    assert BatchProfile(slo_p99_ms=1000.0, default_deadline_ms=300.0).budget_ms() == 150.0
    assert BatchProfile(slo_p99_ms=1000.0, compute_budget_ms=70.0).budget_ms() == 70.0


def test_a_budget_below_one_request_never_starves_throughput() -> None:
    """Issue 17: slo 1000 ms gives a 500 ms budget, but one generation request takes
    2.4 s. Arrivals at 5/s must still be kept up with (the learned cap grows to
    serve the backlog), on a virtual clock: never a cap of 1 under a backlog."""

    def generate_ms(size: int) -> float:
        return 2400.0 + 90.0 * (size - 1)  # 0.4 req/s alone, ~10 req/s at 64

    engine = BatchingEngine(BatchProfile(slo_p99_ms=1000.0))
    rate_per_ms = 5 / 1000.0
    arrivals = [i / rate_per_ms for i in range(600)]  # 120 s at 5 req/s
    now, nxt, served, max_pending = 0.0, 0, 0, 0
    busy_until: float | None = None
    in_flight: Batch | None = None
    sizes_under_backlog = []
    while served < len(arrivals):
        events = [t for t in (busy_until, arrivals[nxt] if nxt < len(arrivals) else None) if t is not None]
        now = min(events)
        if busy_until is not None and now >= busy_until:
            assert in_flight is not None
            engine.completed(in_flight, now, generate_ms(in_flight.size))
            served += in_flight.size
            busy_until, in_flight = None, None
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            engine.offer(request(arrivals[nxt]), now)
            nxt += 1
        max_pending = max(max_pending, engine.pending)
        if busy_until is None:
            pending_before = engine.pending
            batch = engine.poll(now).batch
            if batch is not None:
                if pending_before > 1:
                    sizes_under_backlog.append(batch.size)
                in_flight, busy_until = batch, now + generate_ms(batch.size)
    assert now - arrivals[-1] < 10_000.0, "keeps up: the last request is answered within seconds"
    assert max_pending < 80, f"the queue stays bounded (max {max_pending})"
    assert min(sizes_under_backlog) > 1, "a backlog is never served one request at a time"
    assert engine.curve.latency_cap == 1 and engine.curve.latency_reason == "budget"


def test_step_up_shift_adapts_the_cap_and_says_shift() -> None:
    """The report's incident: a heavier model ships, memory-bound past b=8."""
    engine = BatchingEngine(BatchProfile(hard_cap=48))

    def heavier_after_300(size: int, index: int) -> float:
        return 2.5 * peaked_at_8(size, index) if index >= 300 else linear(size, index)

    records = run_saturated(engine, heavier_after_300, 600)
    assert all(r.effective_cap == 48 for r in records[250:300] if r.cap_reason != "probe")
    shifted = [i for i, r in enumerate(records) if r.cap_reason == "shift"]
    assert shifted and 300 <= shifted[0] <= 306, "detected within a few batches"
    assert engine.curve.shifts == 1
    assert engine.curve.cap == 8 and engine.curve.reason == "knee"
    settled = next(i for i in range(300, 600) if records[i].effective_cap <= 12)
    assert settled - 300 <= 60, f"cap moved after {settled - 300} batches"
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


def test_auto_cap_climbs_to_the_device_limit_on_an_affine_model() -> None:
    engine = BatchingEngine(BatchProfile(), device_cap=96)
    assert engine.ceiling == 96 and engine.curve.reason == "ramp"
    records = run_saturated(engine, linear, 60, arrivals_per_batch=200)
    assert [r.size for r in records[:4]] == [16, 32, 64, 96], "doubles from the ramp start, stops at the limit"
    assert max(r.size for r in records) == 96
    assert engine.target_size == 64, "auto target: two thirds of the learned cap"


def test_auto_cap_without_a_profile_stops_at_the_safe_ceiling() -> None:
    engine = BatchingEngine(BatchProfile())
    records = run_saturated(engine, linear, 30, arrivals_per_batch=300)
    assert engine.ceiling == 128 and max(r.size for r in records) == 128


def test_explicit_hard_cap_stays_a_ceiling_under_the_device_limit() -> None:
    assert BatchingEngine(BatchProfile(hard_cap=48), device_cap=96).ceiling == 48
    assert BatchingEngine(BatchProfile(hard_cap=200), device_cap=96).ceiling == 96
    engine = BatchingEngine(BatchProfile(hard_cap=48, target_size=32), device_cap=96)
    assert engine.target_size == 32


def test_a_measured_profile_starts_the_cap_at_the_knee() -> None:
    points = [(size, peaked_at_8(size, 0)) for size in (1, 2, 4, 8, 16, 32, 64)]
    engine = BatchingEngine(BatchProfile(), device_cap=64, prior_costs=points)
    assert (engine.curve.cap, engine.curve.reason) == (8, "knee")
    records = run_saturated(engine, peaked_at_8, 10)
    assert records[0].size == 8, "no cold probing at the memory limit"


def test_auto_token_cap_ramps_from_a_few_requests_worth_of_tokens() -> None:
    engine = BatchingEngine(BatchProfile(cost_unit="tokens"))
    assert engine.ceiling == 16384 and engine.curve.cap == 2048 and engine.curve.reason == "ramp"


PROFILED = [(1, 10.0), (2, 10.5), (4, 11.0), (8, 13.0), (16, 18.0), (32, 30.0), (64, 60.0)]
"""A device profile whose throughput stops rising at 32: the prefilled knee."""


def test_after_a_shift_drops_a_prefilled_curve_the_cap_ramps_from_what_was_measured() -> None:
    """The demo's incident: a consumer starts from its profile (knee 32, memory limit
    17,469), the live device runs several times slower, the shift drops the profile's
    points, and throughput still rises at the largest size measured since. The cap
    must double from the sizes measured, not jump to the memory limit: a batch of the
    whole queue there took tens of seconds."""
    engine = BatchingEngine(BatchProfile(hard_cap="auto"), device_cap=17_469, prior_costs=PROFILED)
    assert (engine.curve.cap, engine.curve.reason) == (32, "knee")

    def slower_and_affine(size: int, _: int) -> float:
        return 3.0 * (10.0 + 0.9 * size)

    records = run_saturated(engine, slower_and_affine, 200, arrivals_per_batch=3000)
    assert engine.curve.shifts == 1
    largest_done = PROFILED[-1][0]
    for record in records:
        assert record.size <= 2 * largest_done, (
            f"batch {record.batch_id} of {record.size} after at most {largest_done} measured"
        )
        largest_done = max(largest_done, record.size)
    assert 256 <= engine.curve.cap <= 1024, "the ramp still climbs to where throughput stops rising"
    assert max(r.size for r in records) <= 2048
