"""Group membership: the partitions this consumer holds, what it does when they move, and commits.

One place answers for the group, as aiokafka's group coordinator does for
its consumer. Commits run every `commit_interval_ms` and move each owned
partition to its first unanswered record (`commit_points`): at-least-once.
With `KafkaSettings.transactional` the publisher commits inside each
batch's transaction instead, and the loop here does not run. When
partitions are revoked, their waiting requests are withdrawn from the
engine (the next owner reads them again), running batches and publishes
finish, and what they answered is committed before the partitions go.
Partitions assigned start at their stable commit points, skipping what the
previous owner answered past them (`consumers.stable_start`).
After a failure nothing more is committed, so what the consumer held is
redelivered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from consumers.admit import Admission
from consumers.stable_start import StableStart
from pipeline.core.engine.decisions import ServingPolicy
from pipeline.core.kafka.offsets import OffsetTracker

log = logging.getLogger("batchtide.consumer")


class Committer(Protocol):
    """What commits for this member (`consumers.publish.Publisher`)."""

    @property
    def tracker(self) -> OffsetTracker[TopicPartition]: ...

    async def commit(self, partitions: set[TopicPartition] | None = None) -> None: ...

    def joined(self) -> None: ...


def commit_points(
    tracker: OffsetTracker[TopicPartition], owned: set[TopicPartition], partitions: set[TopicPartition] | None = None
) -> dict[TopicPartition, int]:
    """Offsets to commit now: each owned partition's first unanswered record, where it moved
    (of `partitions` only, when given). A partition no longer owned is the new owner's to commit."""
    return {tp: offset for tp, offset in tracker.to_commit(partitions).items() if tp in owned}


class Membership(ConsumerRebalanceListener):
    """This consumer in its group: subscribed by `join`, committing by `commit_every_interval`."""

    def __init__(
        self,
        consumer_id: str,
        priority_topic: str,
        engine: ServingPolicy,
        admission: Admission,
        settle: Callable[[], Awaitable[None]],
    ) -> None:
        self._consumer_id = consumer_id
        self._priority_topic = priority_topic
        self._engine = engine
        self._admission = admission
        self._settle = settle
        """Waits for running batches and publishes (their answers free offsets to commit)."""
        self._kafka: AIOKafkaConsumer | None = None
        self._publisher: Committer | None = None
        self._stable_start: StableStart | None = None
        self._committing = True

    def join(self, kafka: AIOKafkaConsumer, publisher: Committer, topics: list[str], stable_start: StableStart) -> None:
        self._kafka = kafka
        self._publisher = publisher
        self._stable_start = stable_start
        kafka.subscribe(topics, listener=self)

    def owned(self) -> set[TopicPartition]:
        return self._kafka.assignment() if self._kafka is not None else set()

    def owned_priority(self) -> tuple[int, ...]:
        """Partitions of the priority topic held now: where peers send this consumer work."""
        return tuple(sorted(tp.partition for tp in self.owned() if tp.topic == self._priority_topic))

    def stop_committing(self) -> None:
        """After an error no record explains: commit nothing past it."""
        self._committing = False

    async def commit(self, partitions: set[TopicPartition] | None = None) -> None:
        if self._publisher is None or not self._committing:
            return
        await self._publisher.commit(partitions)

    async def commit_every_interval(self, interval_ms: float) -> None:
        while True:
            await asyncio.sleep(interval_ms / 1000.0)
            await self.commit()

    # ---- rebalances (aiokafka calls these inside its poll) ----------------------

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        """Finish in-flight work, commit what it answered, abandon the rest uncommitted."""
        lost = set(revoked)
        if not lost:
            return
        for pending in self._admission.waiting_on(lost):
            self._engine.withdraw(pending)
            self._admission.unwait(pending.payload)
        await self._settle()
        await self.commit(lost)
        if self._publisher is not None:
            self._publisher.tracker.forget(lost)
        if self._stable_start is not None:
            await self._stable_start.revoked(lost)
        log.info("consumer %s: revoked %d partitions", self._consumer_id, len(lost))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        if self._publisher is not None:
            self._publisher.joined()
        if self._stable_start is not None:
            self._stable_start.assigned(set(assigned))
        log.info("consumer %s: assigned %s", self._consumer_id, sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))
