"""The dispatch rules (docs/engine.md): cap, target, window, expiry, collecting while busy."""

from __future__ import annotations

from pipeline.core.config import BatchProfile
from pipeline.core.engine import BatchingEngine
from tests.engine.helpers import request


def test_cap_is_never_exceeded_and_reason_is_hard_cap() -> None:
    engine = BatchingEngine(BatchProfile(target_size=32, hard_cap=48))
    for i in range(100):
        engine.offer(request(float(i) / 10), 10.0)
    decision = engine.poll(10.0)
    assert decision.batch is not None
    record = decision.batch.record
    assert (record.size, record.reason, record.effective_cap) == (48, "hard_cap", 48)
    assert record.queue_depth == 52
    assert engine.poll(10.0).batch is None, "one slot: the second batch waits for completion"


def test_token_cap_packs_in_order_and_sends_an_oversized_request_alone() -> None:
    profile = BatchProfile(cost_unit="tokens", target_size=60, hard_cap=100, adaptive_cap=False)
    engine = BatchingEngine(profile)
    for i, cost in enumerate([30, 40, 50, 20]):
        engine.offer(request(float(i), cost=cost, name=f"c{cost}"), 5.0)
    first = engine.poll(5.0).batch
    assert first is not None
    assert [r.request_id for r in first.requests] == ["c30", "c40"]
    assert (first.record.cost, first.record.reason, first.record.hit_target) == (70, "hard_cap", True)
    engine.completed(first, 6.0, 1.0)
    engine.offer(request(7.0, cost=250, name="huge"), 7.0)
    second = engine.poll(7.0).batch
    assert second is not None
    assert [r.request_id for r in second.requests] == ["c50", "c20"]
    engine.completed(second, 8.0, 1.0)
    third = engine.poll(8.0).batch
    assert third is not None
    assert [r.request_id for r in third.requests] == ["huge"]


def test_target_dispatch_takes_everything_up_to_the_cap() -> None:
    engine = BatchingEngine(BatchProfile(target_size=32, hard_cap=48))
    for i in range(35):
        engine.offer(request(float(i)), 35.0)
    batch = engine.poll(35.0).batch
    assert batch is not None
    assert (batch.size, batch.record.reason, batch.record.hit_target) == (35, "target", True)
    assert batch.record.oldest_wait_ms == 35.0


def test_idle_dispatch_does_not_wait_on_a_single_free_slot() -> None:
    engine = BatchingEngine(BatchProfile(max_wait_ms=20.0))
    engine.offer(request(100.0), 100.0)
    batch = engine.poll(100.0).batch
    assert batch is not None
    assert (batch.size, batch.record.reason, batch.record.window_ms) == (1, "idle", 0.0)
    assert batch.record.hit_target is False


def test_idle_no_wait_even_at_a_steady_low_rate() -> None:
    engine = BatchingEngine(BatchProfile(max_wait_ms=20.0))
    now = 0.0
    for _ in range(50):
        now += 10.0
        engine.offer(request(now), now)
        batch = engine.poll(now).batch
        assert batch is not None and batch.record.reason == "idle"
        engine.completed(batch, now + 2.0, 2.0)


def test_fixed_window_waits_max_wait_from_the_oldest_record_time() -> None:
    engine = BatchingEngine(BatchProfile(adaptive_window=False, max_wait_ms=20.0))
    engine.offer(request(95.0), 100.0)
    held = engine.poll(100.0)
    assert held.batch is None and held.wake_at_ms == 115.0
    engine.offer(request(101.0), 101.0)
    batch = engine.poll(115.0).batch
    assert batch is not None
    assert (batch.size, batch.record.reason, batch.record.window_ms) == (2, "max_wait", 20.0)
    assert batch.record.oldest_wait_ms == 20.0


def test_record_older_than_max_wait_leaves_at_once() -> None:
    engine = BatchingEngine(BatchProfile(adaptive_window=False, max_wait_ms=20.0))
    engine.offer(request(0.0), 500.0)
    batch = engine.poll(500.0).batch
    assert batch is not None and batch.record.reason == "max_wait"


def test_expired_requests_are_returned_not_run() -> None:
    profile = BatchProfile(default_deadline_ms=50.0)
    engine = BatchingEngine(profile)
    engine.offer(request(0.0, name="busy"), 0.0)
    running = engine.poll(0.0).batch
    assert running is not None
    engine.offer(request(1.0, deadline_ms=10.0, name="short"), 1.0)
    engine.offer(request(2.0, name="default"), 2.0)
    waiting = engine.poll(5.0)
    assert waiting.batch is None and waiting.wake_at_ms == 10.0, "busy: wake at the next deadline"
    at_ten = engine.poll(10.0)
    assert [r.request_id for r in at_ten.expired] == ["short"]
    assert at_ten.wake_at_ms == 52.0
    late = engine.poll(60.0)
    assert [r.request_id for r in late.expired] == ["default"]
    assert engine.pending == 0
    engine.completed(running, 61.0, 61.0)
    assert engine.poll(61.0).batch is None
    assert engine.stats()["expired"] == 2


def test_expiry_happens_before_dispatch_at_the_same_instant() -> None:
    engine = BatchingEngine(BatchProfile())
    engine.offer(request(0.0, deadline_ms=5.0, name="late"), 6.0)
    engine.offer(request(1.0, name="ok"), 6.0)
    decision = engine.poll(6.0)
    assert [r.request_id for r in decision.expired] == ["late"]
    assert decision.batch is not None
    assert [r.request_id for r in decision.batch.requests] == ["ok"]


def test_collects_while_busy_and_honours_max_inflight_batches() -> None:
    engine = BatchingEngine(BatchProfile(target_size=4, hard_cap=4, max_inflight_batches=2))
    for i in range(8):
        engine.offer(request(float(i)), 8.0)
    first = engine.poll(8.0)
    assert first.batch is not None and first.wake_at_ms == 8.0, "another slot is free: poll again"
    second = engine.poll(8.0).batch
    assert second is not None and engine.inflight == 2
    for i in range(10):
        engine.offer(request(9.0 + i), 9.0 + i)
    blocked = engine.poll(20.0)
    assert blocked.batch is None and engine.pending == 10
    assert engine.poll(20.0, device_free=False).batch is None
    engine.completed(first.batch, 21.0, 13.0)
    third = engine.poll(21.0).batch
    assert third is not None and third.size == 4 and third.batch_id == 3
    assert engine.poll(21.0).batch is None


def test_device_busy_flag_from_the_driver_blocks_dispatch() -> None:
    engine = BatchingEngine(BatchProfile())
    engine.offer(request(0.0), 0.0)
    assert engine.poll(0.0, device_free=False).batch is None
    assert engine.poll(1.0).batch is not None


def test_batch_ids_increase_from_one_and_records_are_complete() -> None:
    engine = BatchingEngine(BatchProfile(hard_cap=48, target_size=32))
    ids = []
    for step in range(3):
        engine.offer(request(float(step)), float(step))
        batch = engine.poll(float(step), backlog=7).batch
        assert batch is not None
        ids.append(batch.batch_id)
        record = batch.record
        assert record.batch_id == batch.batch_id
        assert record.queue_depth == 7, "the caller's backlog counts toward depth"
        assert record.dispatch_ms == float(step)
        assert record.effective_cap == 48 and record.cap_reason == "configured"
        assert record.target_size == 32
        engine.completed(batch, float(step) + 0.5, 0.5)
    assert ids == [1, 2, 3]


def test_withdrawn_request_is_never_dispatched_nor_expired() -> None:
    engine = BatchingEngine(BatchProfile(target_size=4, hard_cap=8))
    kept = [request(0.0) for _ in range(3)]
    gone = request(0.0, deadline_ms=5.0)
    for r in [*kept, gone]:
        engine.offer(r, 0.0)
    assert engine.withdraw(gone)
    assert not engine.withdraw(gone)
    assert engine.pending == 3
    decision = engine.poll(10.0)
    assert decision.expired == []
    assert decision.batch is not None and decision.batch.requests == kept
    assert not engine.withdraw(kept[0])
