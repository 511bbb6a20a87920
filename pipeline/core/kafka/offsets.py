"""Which offsets may be committed: the contiguous prefix of answered records.

Records of one partition are answered out of order (batches finish in any
order, rejected records are answered at once, expired ones whenever the engine
says). Kafka only knows one committed offset per partition, meaning "every
record before this one is done". So a partition's committable offset is the
first record still unanswered; committing past it could lose that record on a
crash. This module is that bookkeeping and nothing else: no Kafka calls.

The records answered past that point are not lost to the next owner either:
each commit carries them in its metadata string (`CommitPoint`), in the same
transaction, and a new owner that inherits the commit point skips them
(`OffsetTracker.inherit`) instead of answering them twice. After a long stall
the backlog is answered far out of order, so without this a rebalance re-read
hundreds of answered records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)

METADATA_TAG = "bt1"
"""Starts every commit metadata string this module writes (its format's version)."""
METADATA_MAX_CHARS = 4000
"""Under the broker's default `offset.metadata.max.bytes` (4096), which refuses the whole commit."""
METADATA_MAX_OFFSETS = 1_000_000
"""More answered offsets than this in one metadata string is damage, not a backlog: ignored."""


@dataclass(frozen=True, slots=True)
class CommitPoint:
    """A committed offset and the offsets past it already answered (in committed transactions).

    Metadata form: `bt1 3,9-4` = answered offset+3 and offset+9 .. offset+12: comma-separated
    ranges `start[-count]`, each start relative to the commit offset, ascending.
    """

    offset: int
    answered: frozenset[int] = frozenset()

    def encode(self, max_chars: int = METADATA_MAX_CHARS) -> tuple[str, int]:
        """(metadata, answered offsets left out to stay under `max_chars`: the highest ones)."""
        parts: list[str] = []
        length, left_out = len(METADATA_TAG), 0
        for start, count in _ranges(sorted(o for o in self.answered if o >= self.offset)):
            part = str(start - self.offset) + (f"-{count}" if count > 1 else "")
            if left_out or length + 1 + len(part) > max_chars:
                left_out += count
                continue
            parts.append(part)
            length += 1 + len(part)
        return (f"{METADATA_TAG} {','.join(parts)}" if parts else METADATA_TAG), left_out

    @classmethod
    def decode(cls, offset: int, metadata: str | None) -> CommitPoint:
        """The commit point `offset` with what its metadata lists; none for metadata not ours or damaged."""
        tag, _, body = (metadata or "").partition(" ")
        if tag != METADATA_TAG or not body:
            return cls(offset)
        answered: set[int] = set()
        try:
            for part in body.split(","):
                start, _, count = part.partition("-")
                first, n = offset + int(start), int(count) if count else 1
                if n < 1 or len(answered) + n > METADATA_MAX_OFFSETS:
                    return cls(offset)
                answered.update(range(first, first + n))
        except ValueError:
            return cls(offset)
        return cls(offset, frozenset(o for o in answered if o >= offset))


def _ranges(offsets: list[int]) -> list[tuple[int, int]]:
    """Ascending offsets as (start, count) runs."""
    runs: list[tuple[int, int]] = []
    for o in offsets:
        if runs and runs[-1][0] + runs[-1][1] == o:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((o, 1))
    return runs


@dataclass(slots=True)
class PartitionProgress:
    """Offsets received but not yet answered, in arrival (= offset) order."""

    outstanding: deque[int] = field(default_factory=deque)
    done: set[int] = field(default_factory=set)
    next_offset: int | None = None
    """One past the highest offset received: the commit point when nothing is outstanding."""
    inherited: set[int] = field(default_factory=set)
    """Offsets not read yet that a previous owner already answered (its commit's metadata)."""
    saved: int = 0
    """How many answered offsets past the commit point the last commit's metadata listed."""

    def received(self, offset: int) -> bool:
        """Track `offset`; False when a previous owner answered it (it counts as answered now)."""
        self.outstanding.append(offset)
        self.next_offset = offset + 1
        if offset in self.inherited:
            self.inherited.discard(offset)
            self.answered(offset)
            return False
        return True

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

    @property
    def answered_past(self) -> int:
        """How many offsets past the commit point are answered (here or by a previous owner)."""
        return len(self.done) + len(self.inherited)

    def point(self, offset: int) -> CommitPoint:
        """Committing `offset`: what is answered past it, here or by a previous owner."""
        return CommitPoint(offset, frozenset(o for o in (*self.done, *self.inherited) if o >= offset))


class OffsetTracker(Generic[P]):
    """Per-partition contiguous completion; hands out only offsets not yet committed."""

    def __init__(self) -> None:
        self._parts: dict[P, PartitionProgress] = {}
        self._committed: dict[P, int] = {}

    def received(self, partition: P, offset: int) -> bool:
        """Track a record read; False when it was answered by a previous owner (skip it)."""
        progress = self._parts.get(partition)
        if progress is None:
            progress = self._parts[partition] = PartitionProgress()
        return progress.received(offset)

    def inherit(self, partition: P, point: CommitPoint) -> None:
        """Start `partition` over at a commit point read from the group: reading resumes at its
        offset and the offsets it lists as answered are skipped and carried into our commits."""
        self._parts[partition] = PartitionProgress(
            next_offset=point.offset, inherited=set(point.answered), saved=len(point.answered)
        )
        self._committed[partition] = point.offset

    def point(self, partition: P, offset: int) -> CommitPoint:
        """The commit point for committing `offset` on `partition` (with the answered past it)."""
        progress = self._parts.get(partition)
        return progress.point(offset) if progress else CommitPoint(offset)

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
        """Offsets that moved, or whose answered records past them grew, since the last
        `committed()` call (optionally only `partitions`). While the first unanswered record
        holds a partition's offset, a commit still tells the next owner what was answered past it."""
        out: dict[P, int] = {}
        for partition, progress in self._parts.items():
            if partitions is not None and partition not in partitions:
                continue
            offset = progress.committable
            if offset is None:
                continue
            last = self._committed.get(partition, -1)
            if offset > last or (offset == last and progress.answered_past > progress.saved):
                out[partition] = offset
        return out

    def committed(self, offsets: Mapping[P, int | CommitPoint]) -> None:
        """Offsets (or the commit points, with what their metadata listed) that are committed now."""
        for partition, committed in offsets.items():
            offset = committed.offset if isinstance(committed, CommitPoint) else committed
            if offset < self._committed.get(partition, -1):
                continue
            self._committed[partition] = offset
            progress = self._parts.get(partition)
            if progress is not None:
                progress.saved = (
                    len(committed.answered) if isinstance(committed, CommitPoint) else progress.answered_past
                )

    def forget(self, partitions: set[P]) -> None:
        """Drop revoked partitions: their unanswered records belong to the next owner now."""
        for partition in partitions:
            self._parts.pop(partition, None)
            self._committed.pop(partition, None)
