"""The pure parts of the consumer: commit points."""

from __future__ import annotations

from aiokafka import TopicPartition

from pipeline.core.kafka.offsets import OffsetTracker

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
