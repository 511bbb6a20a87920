"""Rule 4: dispatch order (marked, priority, record time) and sticky tail marking."""

from __future__ import annotations

from pipeline.core.config import BatchProfile
from pipeline.core.engine import Batch, BatchingEngine
from tests.engine.helpers import request


def _ids(batch: Batch | None) -> list[str]:
    assert batch is not None
    return [r.request_id for r in batch.requests]


def test_priority_levels_then_fifo_by_record_time_not_arrival_order() -> None:
    engine = BatchingEngine(BatchProfile(priority_levels=3, max_wait_ms=0.0))
    for name, priority, enqueue in [
        ("p1-t5", 1, 5.0),
        ("p0-t7", 0, 7.0),
        ("p0-t3", 0, 3.0),
        ("p2-t1", 2, 1.0),
        ("p1-t2", 1, 2.0),
        ("p9-t0", 9, 0.0),
    ]:
        engine.offer(request(enqueue, priority=priority, name=name), 10.0)
    assert _ids(engine.poll(10.0).batch) == ["p0-t3", "p0-t7", "p1-t2", "p1-t5", "p9-t0", "p2-t1"]


def _profile(**changes: object) -> BatchProfile:
    base = BatchProfile(
        target_size=4,
        hard_cap=4,
        tail_min_samples=4,
        wait_sample_window=4,
        tail_mark_ratio=2.0,
        tail_mark_quantile=0.5,
        tail_mark_floor_ms=0.0,
        tail_mark_max_share=1.0,
        adaptive_window=False,
        max_wait_ms=10.0,
        adaptive_cap=False,
    )
    return base.replace(**changes)


def _seed_p50(engine: BatchingEngine, wait_ms: float, samples: int) -> float:
    """Dispatch `samples` requests that each waited `wait_ms`; returns the time after."""
    now = 0.0
    for _ in range(samples):
        engine.offer(request(now), now)
        now += wait_ms
        batch = engine.poll(now).batch
        assert batch is not None and batch.record.oldest_wait_ms == wait_ms
        engine.completed(batch, now, 0.1)
    return now


def test_no_marking_before_min_samples() -> None:
    engine = BatchingEngine(_profile())
    now = _seed_p50(engine, 10.0, 3)
    engine.offer(request(now - 500.0, priority=2, name="old-low"), now)
    engine.offer(request(now, priority=0, name="new-high"), now)
    batch = engine.poll(now + 10.0).batch
    assert _ids(batch) == ["new-high", "old-low"]
    assert batch is not None and batch.record.marked_count == 0


def test_marks_past_ratio_times_p50_and_sends_marked_first() -> None:
    engine = BatchingEngine(_profile())
    now = _seed_p50(engine, 10.0, 4)
    assert engine.stats()["p50_wait_ms"] == 10.0
    engine.offer(request(now - 21.0, priority=2, name="tail"), now)
    engine.offer(request(now - 19.0, priority=2, name="not-yet"), now)
    engine.offer(request(now, priority=0, name="urgent"), now)
    engine.offer(request(now, priority=1, name="normal"), now)
    batch = engine.poll(now).batch
    assert _ids(batch) == ["tail", "urgent", "normal", "not-yet"]
    assert batch is not None and batch.record.marked_count == 1
    tail = batch.requests[0]
    assert tail.marked and tail.marked_at_ms == now - 21.0 + 20.0
    assert not batch.requests[3].marked
    assert engine.stats()["marked_share"] == 1 / 8


def test_marked_requests_leave_oldest_first_and_stay_marked() -> None:
    engine = BatchingEngine(_profile())
    now = _seed_p50(engine, 10.0, 4)
    for i, priority in enumerate([2, 1, 2, 0, 1, 2]):
        engine.offer(request(now - 40.0 + i, priority=priority, name=f"old{i}"), now)
    first = engine.poll(now).batch
    assert _ids(first) == ["old0", "old1", "old2", "old3"]
    assert first is not None and first.record.marked_count == 4
    engine.completed(first, now + 1.0, 1.0)
    # The p50 is now ~40 ms, so the two left (waiting ~36-40 ms) would not be
    # marked today; marking is sticky and they still go before a fresh urgent one.
    assert engine.stats()["p50_wait_ms"] >= 37.0
    engine.offer(request(now + 1.0, priority=0, name="fresh-urgent"), now + 1.0)
    second = engine.poll(now + 1.0).batch
    assert _ids(second) == ["old4", "old5", "fresh-urgent"]
    assert second is not None and second.record.marked_count == 2


def test_a_burst_spends_the_mark_budget_on_its_oldest_requests() -> None:
    """Every request of a burst waits past the calm's threshold; with a 25% budget
    over a window of 8 only two marks are there to spend, and they go to the oldest
    requests whatever their level. The budget refills by a quarter per dispatch."""
    engine = BatchingEngine(_profile(tail_mark_max_share=0.25, wait_sample_window=8, hard_cap=8, target_size=8))
    now = _seed_p50(engine, 10.0, 4)
    for i, priority in enumerate([0, 2, 1, 0, 2, 1]):
        engine.offer(request(now - 60.0 + i, priority=priority, name=f"burst{i}"), now)
    engine.offer(request(now, priority=0, name="fresh"), now)
    batch = engine.poll(now).batch
    assert _ids(batch) == ["burst0", "burst1", "burst3", "fresh", "burst2", "burst5", "burst4"]
    assert batch is not None and batch.record.marked_count == 2
    engine.completed(batch, now + 1.0, 1.0)
    for i in range(6):
        engine.offer(request(now - 300.0 + i, priority=2, name=f"late{i}"), now + 1.0)
    again = engine.poll(now + 1.0).batch
    assert again is not None and again.record.marked_count == 1, "7 dispatched x 0.25 refilled one whole mark"


def test_marking_off_with_ratio_zero() -> None:
    engine = BatchingEngine(_profile(tail_mark_ratio=0.0))
    now = _seed_p50(engine, 10.0, 4)
    engine.offer(request(now - 500.0, priority=2, name="old-low"), now)
    engine.offer(request(now, priority=0, name="new-high"), now)
    assert _ids(engine.poll(now).batch) == ["new-high", "old-low"]


def test_default_floor_is_max_wait_so_idle_zero_waits_mark_nothing() -> None:
    profile = _profile(tail_mark_floor_ms=None, max_wait_ms=10.0, adaptive_window=True)
    engine = BatchingEngine(profile)
    now = 0.0
    for _ in range(8):
        engine.offer(request(now), now)
        batch = engine.poll(now).batch
        assert batch is not None and batch.record.oldest_wait_ms == 0.0
        engine.completed(batch, now, 0.1)
        now += 1.0
    engine.offer(request(now - 9.0, priority=2, name="waited-9"), now)
    engine.offer(request(now, priority=0, name="urgent"), now)
    assert _ids(engine.poll(now).batch) == ["urgent", "waited-9"]


def test_default_threshold_is_the_upper_tail_not_a_multiple_of_a_zero_p50() -> None:
    """Most waits are 0 (idle dispatch), 3% waited 100 ms: 2 x p50 would be 0 and mark
    every request that waited at all; 1.5 x the p99 marks only what waited past 150 ms."""
    engine = BatchingEngine(
        BatchProfile(
            hard_cap=4,
            target_size=4,
            tail_mark_floor_ms=0.0,
            adaptive_cap=False,
            adaptive_window=False,
            max_wait_ms=0.0,
        )
    )
    now = 0.0
    for i in range(400):
        wait = 100.0 if i % 33 == 0 else 0.0
        engine.offer(request(now - wait), now)
        batch = engine.poll(now).batch
        assert batch is not None
        engine.completed(batch, now, 0.1)
        now += 1.0
    assert engine.stats()["p50_wait_ms"] == 0.0
    assert engine.stats()["tail_threshold_ms"] == 150.0
    engine.offer(request(now - 120.0, priority=2, name="waited-120"), now)
    engine.offer(request(now - 160.0, priority=2, name="waited-160"), now)
    engine.offer(request(now, priority=0, name="urgent"), now)
    batch = engine.poll(now).batch
    assert _ids(batch) == ["waited-160", "urgent", "waited-120"]
    assert batch is not None and batch.record.marked_count == 1
