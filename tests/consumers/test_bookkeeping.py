"""The pure parts of the consumer: commit points and the choice of tails to forward."""

from __future__ import annotations

from aiokafka import TopicPartition

from consumers.answers import Held
from consumers.forwarding import tails_to_forward
from pipeline.kafka.offsets import OffsetTracker
from pipeline.engine.decisions import PendingRequest
from schemas.messages import Request

TP = TopicPartition("t", 0)


def test_commit_point_stops_at_the_first_unanswered_offset() -> None:
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    for offset in range(10, 16):
        tracker.received(TP, offset)
    assert tracker.to_commit() == {TP: 10}
    for offset in (11, 12, 14):
        tracker.answered(TP, offset)
    assert tracker.to_commit() == {TP: 10}
    tracker.answered(TP, 10)
    assert tracker.to_commit() == {TP: 13}
    tracker.committed({TP: 13})
    assert tracker.to_commit() == {}
    tracker.answered(TP, 13)
    tracker.answered(TP, 15)
    assert tracker.to_commit() == {TP: 16}
    assert tracker.outstanding(TP) == 0


def test_a_revoked_partition_is_forgotten_and_never_committed() -> None:
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    other = TopicPartition("t", 1)
    tracker.received(TP, 0)
    tracker.received(other, 5)
    tracker.answered(other, 5)
    tracker.forget({TP})
    assert tracker.to_commit() == {other: 6}
    tracker.answered(TP, 0)
    assert tracker.to_commit() == {other: 6}


def _pending(i: int, *, marked: bool = False, forwarded_in: bool = False) -> PendingRequest:
    request = Request(id=f"r{i}", model="m", text="x")
    held = Held(request, b"{}", TP, i, enqueue_ms=1000 + i, fetch_ms=2000, tokens_in=1, tokens_out=0, forwarded_in=forwarded_in)
    return PendingRequest(request.id, float(1000 + i), payload=held, marked=marked)


def test_only_overdue_requests_beyond_the_next_batch_are_forwarded_and_never_twice() -> None:
    """Overdue is the record time, not the mark: marks are rationed, forwarding is not."""
    waiting = [_pending(i, marked=i == 15) for i in range(20)]
    waiting.append(_pending(-5, forwarded_in=True))
    chosen = tails_to_forward(reversed(waiting), next_batch=4, overdue_before_ms=1012.0)
    assert [pr.request_id for pr in chosen] == [f"r{i}" for i in range(4, 12)]
    assert tails_to_forward(waiting, next_batch=12, overdue_before_ms=1012.0) == []
