"""Rule 3: the window follows rate and depth, and is non-zero only where waiting pays."""

from __future__ import annotations

from pipeline.core.config import BatchProfile
from pipeline.core.engine import BatchingEngine
from tests.engine.helpers import request


def _teach_linear_curve(engine: BatchingEngine, fixed_ms: float, per_item_ms: float) -> None:
    """Show the engine one completed batch per size so it knows t(b) = a + c b."""
    now = -10_000.0
    for size in range(1, engine.ceiling + 1):
        for _ in range(size):
            engine.offer(request(now), now)
        decision = engine.poll(now)
        assert decision.batch is not None, "every slot is free: no reason to hold"
        compute = fixed_ms + per_item_ms * size
        engine.completed(decision.batch, now + compute, compute)
        now += 100.0


def _window_at_rate(rate_per_ms: float, *, slots: int, backlog: int = 0) -> tuple[float, str]:
    """Window the engine opens for a stream at `rate_per_ms`, with one batch in flight."""
    profile = BatchProfile(max_inflight_batches=slots, max_wait_ms=20.0, hard_cap=48, rate_halflife_ms=2.0)
    engine = BatchingEngine(profile)
    _teach_linear_curve(engine, fixed_ms=40.0, per_item_ms=1.0)
    engine.offer(request(0.0), 0.0)
    occupying = engine.poll(0.0).batch
    assert occupying is not None
    now = 0.0
    for _ in range(6):
        now += 1.0 / rate_per_ms
        engine.offer(request(now), now)
    decision = engine.poll(now, backlog=backlog)
    if decision.batch is not None:
        return decision.batch.record.window_ms, decision.batch.record.reason
    assert decision.wake_at_ms is not None
    oldest = 1.0 / rate_per_ms
    return decision.wake_at_ms - oldest, "held"


def test_window_shrinks_as_the_rate_rises_when_the_last_slot_would_be_taken() -> None:
    windows = [_window_at_rate(rate, slots=2)[0] for rate in (0.5, 1.0, 2.0, 4.0)]
    assert all(0.0 < w <= 20.0 for w in windows), windows
    assert windows == sorted(windows, reverse=True) and windows[0] > windows[-1], windows


def test_single_slot_never_waits_even_at_a_rate_where_two_slots_would() -> None:
    assert _window_at_rate(1.0, slots=2)[1] == "held"
    profile = BatchProfile(max_inflight_batches=1, rate_halflife_ms=5.0, target_size=32, hard_cap=48)
    engine = BatchingEngine(profile)
    _teach_linear_curve(engine, fixed_ms=40.0, per_item_ms=1.0)
    now = 0.0
    for _ in range(6):
        now += 1.0
        engine.offer(request(now), now)
    batch = engine.poll(now).batch
    assert batch is not None and batch.record.reason == "idle" and batch.record.window_ms == 0.0


def test_a_free_second_slot_means_no_wait() -> None:
    profile = BatchProfile(max_inflight_batches=3, rate_halflife_ms=5.0, target_size=32, hard_cap=48)
    engine = BatchingEngine(profile)
    _teach_linear_curve(engine, fixed_ms=40.0, per_item_ms=1.0)
    engine.offer(request(0.0), 0.0)
    assert engine.poll(0.0).batch is not None
    for i in range(1, 7):
        engine.offer(request(float(i)), float(i))
    batch = engine.poll(6.0).batch
    assert batch is not None and batch.record.reason == "idle"


def test_backlog_counts_toward_depth_and_shortens_the_window() -> None:
    without, _ = _window_at_rate(2.0, slots=2)
    with_backlog, _ = _window_at_rate(2.0, slots=2, backlog=10)
    full_backlog, reason = _window_at_rate(2.0, slots=2, backlog=40)
    assert 0.0 < with_backlog < without
    assert reason == "idle" and full_backlog == 0.0


def test_held_batch_leaves_at_the_window_with_reason_max_wait() -> None:
    profile = BatchProfile(max_inflight_batches=2, max_wait_ms=20.0, rate_halflife_ms=5.0, target_size=32, hard_cap=48)
    engine = BatchingEngine(profile)
    _teach_linear_curve(engine, fixed_ms=40.0, per_item_ms=1.0)
    engine.offer(request(0.0), 0.0)
    assert engine.poll(0.0).batch is not None
    now = 0.0
    for _ in range(6):
        now += 2.0
        engine.offer(request(now), now)
    held = engine.poll(now)
    assert held.batch is None and held.wake_at_ms is not None
    batch = engine.poll(held.wake_at_ms).batch
    assert batch is not None
    assert batch.record.reason == "max_wait"
    assert 0.0 < batch.record.window_ms <= 20.0
    assert batch.record.oldest_wait_ms <= 20.0


def test_min_wait_is_a_floor_of_the_window() -> None:
    engine = BatchingEngine(BatchProfile(min_wait_ms=5.0, max_wait_ms=20.0))
    engine.offer(request(0.0), 0.0)
    held = engine.poll(0.0)
    assert held.batch is None and held.wake_at_ms == 5.0
    batch = engine.poll(5.0).batch
    assert batch is not None and batch.record.window_ms == 5.0
