"""Which offsets may be committed: the contiguous prefix of answered records.

Records of one partition are answered out of order (batches finish in any
order, rejected records are answered at once, expired ones whenever the engine
says). Kafka only knows one committed offset per partition, meaning "every
record before this one is done". So a partition's committable offset is the
first record still unanswered; committing past it could lose that record on a
crash. This module is that bookkeeping and nothing else: no Kafka calls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Hashable, TypeVar

P = TypeVar("P", bound=Hashable)


@dataclass(slots=True)
class PartitionProgress:
    """Offsets received but not yet answered, in arrival (= offset) order."""

    outstanding: deque[int] = field(default_factory=deque)
    done: set[int] = field(default_factory=set)
    next_offset: int | None = None
    """One past the highest offset received: the commit point when nothing is outstanding."""

    def received(self, offset: int) -> None:
        self.outstanding.append(offset)
        self.next_offset = offset + 1

    def answered(self, offset: int) -> None:
        self.done.add(offset)
        outstanding, done = self.outstanding, self.done
        while outstanding and outstanding[0] in done:
            done.discard(outstanding.popleft())

    @property
    def committable(self) -> int | None:
        """Offset to commit (Kafka convention: the next record to read), or None."""
        if self.outstanding:
            return self.outstanding[0]
        return self.next_offset


class OffsetTracker(Generic[P]):
    """Per-partition contiguous completion; hands out only offsets not yet committed."""

    def __init__(self) -> None:
        self._parts: dict[P, PartitionProgress] = {}
        self._committed: dict[P, int] = {}

    def received(self, partition: P, offset: int) -> None:
        progress = self._parts.get(partition)
        if progress is None:
            progress = self._parts[partition] = PartitionProgress()
        progress.received(offset)

    def answered(self, partition: P, offset: int) -> None:
        progress = self._parts.get(partition)
        if progress is not None:
            progress.answered(offset)

    def next_offset(self, partition: P) -> int | None:
        """One past the highest offset received from `partition` (the fetch position)."""
        progress = self._parts.get(partition)
        return progress.next_offset if progress else None

    def outstanding(self, partition: P) -> int:
        progress = self._parts.get(partition)
        return len(progress.outstanding) if progress else 0

    def to_commit(self, partitions: set[P] | None = None) -> dict[P, int]:
        """Offsets that moved since the last `committed()` call (optionally only `partitions`)."""
        out: dict[P, int] = {}
        for partition, progress in self._parts.items():
            if partitions is not None and partition not in partitions:
                continue
            offset = progress.committable
            if offset is not None and offset > self._committed.get(partition, -1):
                out[partition] = offset
        return out

    def committed(self, offsets: dict[P, int]) -> None:
        for partition, offset in offsets.items():
            if offset > self._committed.get(partition, -1):
                self._committed[partition] = offset

    def forget(self, partitions: set[P]) -> None:
        """Drop revoked partitions: their unanswered records belong to the next owner now."""
        for partition in partitions:
            self._parts.pop(partition, None)
            self._committed.pop(partition, None)
