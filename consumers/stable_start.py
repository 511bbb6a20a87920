"""A new owner of a partition starts where the last owner's answers really end.

The committed offset is the first record the last owner left unanswered;
records past it may have been answered already (after a long stall the
backlog is answered far out of order), and the commit's metadata lists them
(`pipeline.core.kafka.offsets.CommitPoint`). So a newly assigned partition
is held paused until its commit point is known for certain: OffsetFetch v7
with `require_stable` (`pipeline.core.kafka.offset_fetch`), asked again while
the coordinator answers UNSTABLE_OFFSET_COMMIT (a transaction carrying its
offsets is still open), for at most `STABLE_WAIT_S`. Then the partition is
moved to that offset, the answered records are skipped as they are read
(`OffsetTracker.inherit`), and the fetcher resumes it. aiokafka's own fetch
of the committed offset (v3) is overridden by the seek: it cannot wait for
open transactions and does not read our metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from consumers.clock import Clock
from consumers.stats import ConsumerStats
from pipeline.core.kafka.offset_fetch import NO_OFFSET, UNSTABLE_OFFSET_COMMIT, Committed, fetch_committed
from pipeline.core.kafka.offsets import CommitPoint, OffsetTracker

log = logging.getLogger("batchtide.consumer")

STABLE_WAIT_S = 30.0
"""How long a partition waits for open transactions on its offsets before it starts from the last stable commit."""
RETRY_S = 0.2
"""Pause between two asks while an offset is unstable or the coordinator unavailable."""
ASK_AGAIN = {UNSTABLE_OFFSET_COMMIT, 14, 15, 16}
"""Partition errors worth asking again for: unstable, coordinator loading, not available, moved."""


class StableStart:
    """Holds newly assigned partitions until their commit points are stable, then starts them there."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        tracker: OffsetTracker[TopicPartition],
        group_id: str,
        stats: ConsumerStats,
        clock: Clock,
        wait_s: float = STABLE_WAIT_S,
    ) -> None:
        self._consumer = consumer
        self._tracker = tracker
        self._group_id = group_id
        self._stats = stats
        self._clock = clock
        self._wait_s = wait_s
        self.holding: set[TopicPartition] = set()
        """Assigned partitions not started yet: the fetcher keeps them paused."""
        self._task: asyncio.Task[None] | None = None

    def assigned(self, partitions: set[TopicPartition]) -> None:
        """Pause `partitions` now (inside the rebalance, before anything is fetched) and start them
        in the background once their commit points are known."""
        if not partitions:
            return
        for tp in partitions:
            self._consumer.pause(tp)
        self.holding |= partitions
        if self._task is not None:
            self._task.cancel()  # the new task starts everything still held
        self._task = asyncio.create_task(self._start(set(self.holding)), name="stable-start")

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        """Revoked before they started: forget them (the task starts only what is still held)."""
        self.holding -= partitions
        if not self.holding:
            await self.stop()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _start(self, partitions: set[TopicPartition]) -> None:
        try:
            points = await self._stable_points(sorted(partitions, key=lambda tp: (tp.topic, tp.partition)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never strand a partition paused: fall back to aiokafka's own position
            log.warning("consumer group %s: no stable commit points (%r); starting from aiokafka's", self._group_id, e)
            points = {}
        inherited = 0
        for tp in partitions:
            if tp not in self.holding:
                continue
            point = points.get(tp)
            if point is not None:
                self._tracker.inherit(tp, point)
                self._consumer.seek(tp, point.offset)
                inherited += len(point.answered)
            self.holding.discard(tp)
        self._stats.answered_inherited += inherited
        log.info(
            "consumer group %s: %d of %d partitions start at their stable commit points, %d answered records inherited",
            self._group_id,
            len(points),
            len(partitions),
            inherited,
        )

    async def _stable_points(self, partitions: list[TopicPartition]) -> dict[TopicPartition, CommitPoint]:
        """Each partition's commit point, asked again while unstable; past the wait, the last stable one."""
        give_up_at = self._clock.monotonic_s() + self._wait_s
        points: dict[TopicPartition, CommitPoint] = {}
        unstable_seen: set[TopicPartition] = set()
        left = [tp for tp in partitions if tp in self.holding]
        while left:
            late = self._clock.monotonic_s() >= give_up_at
            answers = await self._ask(left, require_stable=not late)
            for tp, committed in (answers or {}).items():
                if committed.error == 0 and committed.offset != NO_OFFSET:
                    points[tp] = CommitPoint.decode(committed.offset, committed.metadata)
                elif committed.error == UNSTABLE_OFFSET_COMMIT:
                    unstable_seen.add(tp)
                elif committed.error not in ASK_AGAIN:
                    log.info("consumer group %s: offset fetch of %s: error %d", self._group_id, tp, committed.error)
            if late:  # the last ask did not require stable offsets: what it got is what there is
                self._stats.unstable_offsets_given_up += len(set(left) & unstable_seen)
                break
            if answers is not None:
                left = [tp for tp in left if tp in self.holding and tp in answers and answers[tp].error in ASK_AGAIN]
            if left:
                await asyncio.sleep(RETRY_S)
        self._stats.unstable_offsets_waited += len(unstable_seen)
        return points

    async def _ask(
        self, partitions: list[TopicPartition], *, require_stable: bool
    ) -> dict[TopicPartition, Committed] | None:
        """One OffsetFetch v7 to the coordinator; None when it could not answer for the group."""
        coordinator = self._consumer._coordinator
        node = coordinator.coordinator_id
        if node is None:
            return None
        try:
            error, answers = await fetch_committed(
                self._consumer._client, node, self._group_id, partitions, require_stable=require_stable
            )
        except KafkaError as e:
            log.info("consumer group %s: offset fetch from node %s failed (%r); asking again", self._group_id, node, e)
            return None
        if error:
            log.info("consumer group %s: offset fetch error %d; asking again", self._group_id, error)
            return None
        return answers
