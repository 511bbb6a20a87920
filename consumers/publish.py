"""The end of a record's path: publish what answers it, then commit the offsets that frees.

A record counts as answered only once its answer, dead letter or forward is
on the broker (`consumers.delivery` gets it there in some form, never
raising a produce error). Committing then moves each partition to its first
unanswered record (`pipeline.core.kafka.offsets`), its metadata listing the
records answered past it (the next owner skips them): at-least-once. With
`KafkaSettings.transactional` the records and the offsets they free go into
one Kafka transaction: exactly-once answers. A record refused inside a
transaction aborts it; the refused records are replaced and the whole
transaction runs again.

Transactions run one at a time, and each costs several round trips to the
brokers (add partitions, produce, add offsets, commit offsets, end), each
acknowledged by every in-sync replica on a cluster. One transaction per batch
caps a consumer at a few dozen batches a second: on a three-broker cluster the
answers of small batches queued behind each other for 15-20 s. So batches that
finish while a transaction is in flight wait for it together and go out in
the next one (group commit): one transaction carries every answer ready by then.

Before a transaction that carries offsets commits, the consumer checks that
its group membership is fresh (`consumers.fencing`). If it is not, the transaction is
aborted (`transactions_self_fenced`); while the generation holds, it runs
again once a heartbeat is accepted; once the generation moved, its records
are left unanswered for whoever owns their partitions now.

The check cannot see what the coordinator did while it could not answer,
so the broker checks too: the transaction's offsets go as TxnOffsetCommit
v3 with this member's generation and member id
(`pipeline.core.kafka.txn_offset_commit`). If the coordinator no longer
counts this member in that generation it refuses them; the transaction is
aborted (`txn_offsets_refused`) and its records are left for the
partitions' new owners.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from consumers.delivery import Delivery
from consumers.fencing import LEFT_FOR_OWNERS, NO_GENERATION, SELF_FENCED, MembershipGuard
from consumers.membership import commit_points
from consumers.stats import ConsumerStats
from pipeline.core.kafka.offsets import CommitPoint, OffsetTracker
from pipeline.core.kafka.outbox import Failure, Message, Outbox
from pipeline.core.kafka.txn_offset_commit import TxnOffsetsRefused

log = logging.getLogger("batchtide.consumer")

Place = tuple[TopicPartition, int]
"""(partition, offset) of a source record."""


def _plain(points: dict[TopicPartition, CommitPoint]) -> dict[TopicPartition, int]:
    """Commit points as bare offsets, for a log line."""
    return {tp: point.offset for tp, point in points.items()}


class _Refused(Exception):
    """Aborts a transaction in which the broker refused records."""

    def __init__(self, failures: list[Failure]) -> None:
        super().__init__(f"{len(failures)} records refused")
        self.failures = failures


class _SelfFenced(Exception):
    """Aborts a transaction whose offsets this consumer may no longer own."""


TXN_OFFSETS_REFUSED = "txn offsets refused:"
"""Starts the log line of a transaction whose offsets the group coordinator refused (the chaos rows count them)."""
SELF_FENCED_RETRY_S = 0.5
"""How often a self-fenced transaction looks again at the membership."""


class Publisher:
    """Publishes records for source offsets and commits the contiguous answered prefix."""

    def __init__(
        self,
        *,
        transactional: bool,
        group_id: str,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        outbox: Outbox,
        delivery: Delivery,
        stats: ConsumerStats,
        guard: MembershipGuard,
    ) -> None:
        self.transactional = transactional
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._group_id = group_id
        self._producer = producer
        self._consumer = consumer
        self._outbox = outbox
        self._delivery = delivery
        self._stats = stats
        self._guard = guard
        self._txn_lock = asyncio.Lock()
        self._txn_queue: list[tuple[Sequence[Message], Sequence[Place], int, asyncio.Future[bool]]] = []
        """Batches waiting for the next transaction (see the module's note on group commit), with
        the group generation each was published under."""

    async def publish(self, messages: Sequence[Message], done: Sequence[Place], refused: Sequence[Place] = ()) -> bool:
        """Produce `messages` (or what `Delivery` makes of them); then `done` counts as answered.
        False: self-fenced, nothing published, the records are the partitions' new owners' to answer.
        `refused`: those of `done` refused at admission; their offsets commit like the rest here (a share
        group rejects them instead: consumers/sharing.py)."""
        delivery = self._delivery
        try:
            if self.transactional:
                return await self._publish_transaction(messages, done)
            await delivery.deliver(messages)
            for tp, offset in done:
                self.tracker.answered(tp, offset)
            return True
        finally:
            self._stats.rebuilt, self._stats.delivery_retries = delivery.rebuilt, delivery.retries

    async def _publish_transaction(self, messages: Sequence[Message], done: Sequence[Place]) -> bool:
        """Queue the batch; whoever gets the lock next publishes everything queued in one transaction."""
        mine: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        generation = self._guard.generation
        self._txn_queue.append((messages, done, generation, mine))
        async with self._txn_lock:
            if not mine.done():
                # one generation per transaction: a batch of another waits for its own
                queued = [q for q in self._txn_queue if q[2] == generation]
                self._txn_queue = [q for q in self._txn_queue if q[2] != generation]
                try:
                    published = await self._transaction(
                        [m for q in queued for m in q[0]], [p for q in queued for p in q[1]], generation
                    )
                except BaseException as e:
                    for _, _, _, waiting in queued:
                        if waiting is not mine and not waiting.done():
                            if isinstance(e, asyncio.CancelledError):
                                waiting.cancel()
                            else:
                                waiting.set_exception(e)
                    raise
                for _, _, _, waiting in queued:
                    if not waiting.done():
                        waiting.set_result(published)
        return await mine

    async def _transaction(self, messages: Sequence[Message], done: Sequence[Place], generation: int) -> bool:
        """One transaction for `messages` and the offsets `done` frees, published under `generation`;
        False when self-fenced for good or its offsets were refused (given up either way)."""
        while True:
            try:
                await self._attempts(messages, done, generation)
                return True
            except TxnOffsetsRefused as refused:
                self._refused(refused)
                return False
            except _SelfFenced as fenced:
                self._stats.transactions_self_fenced += 1
                if generation == NO_GENERATION or self._guard.generation != generation:
                    log.warning("%s for the partitions' owners, transaction aborted: %s", LEFT_FOR_OWNERS, fenced)
                    return False
                log.warning("%s transaction aborted until a heartbeat is accepted: %s", SELF_FENCED, fenced)
                await asyncio.sleep(SELF_FENCED_RETRY_S)

    async def _attempts(self, messages: Sequence[Message], done: Sequence[Place], generation: int) -> None:
        producer, outbox = self._producer, self._outbox

        async def attempt(batch: Sequence[Message]) -> list[Failure]:
            if done and (why := self._guard.stale(generation)):
                raise _SelfFenced(why)
            try:
                async with producer.transaction():
                    errors = await outbox.send_all(batch)
                    refused = [(m, e) for m, e in zip(batch, errors, strict=True) if e is not None]
                    if refused:
                        raise _Refused(refused)
                    for tp, offset in done:
                        self.tracker.answered(tp, offset)
                    points = self._commit_points()
                    if points:
                        await producer.send_offsets_to_transaction(self._with_metadata(points), self._group_id)
                        if why := self._guard.stale(generation):
                            raise _SelfFenced(why)
            except _Refused as refusal:
                return refusal.failures
            self.tracker.committed(points)
            self._stats.commits += 1 if points else 0
            return []

        await self._delivery.until_accepted(messages, attempt, all_or_nothing=True)

    def _refused(self, refused: TxnOffsetsRefused) -> None:
        self._stats.txn_offsets_refused += 1
        log.warning("%s transaction aborted, records left for the partitions' owners: %s", TXN_OFFSETS_REFUSED, refused)

    def joined(self) -> None:
        """The group assigned partitions: membership is confirmed as of now."""
        self._guard.joined()

    def _commit_points(self, partitions: set[TopicPartition] | None = None) -> dict[TopicPartition, CommitPoint]:
        """What to commit now: each offset with the records answered past it."""
        tracker = self.tracker
        return {
            tp: tracker.point(tp, offset)
            for tp, offset in commit_points(tracker, self._consumer.assignment(), partitions).items()
        }

    def _with_metadata(self, points: dict[TopicPartition, CommitPoint]) -> dict[TopicPartition, tuple[int, str]]:
        """Each offset with the metadata that lists what is answered past it."""
        out: dict[TopicPartition, tuple[int, str]] = {}
        for tp, point in points.items():
            metadata, left_out = point.encode()
            self._stats.answered_left_out_of_metadata = max(self._stats.answered_left_out_of_metadata, left_out)
            out[tp] = (point.offset, metadata)
        return out

    async def commit(self, partitions: set[TopicPartition] | None = None) -> None:
        """Commit what is answered (of `partitions`, default all); a failed commit is retried later."""
        if self.transactional:
            await self._commit_transaction(partitions)
            return
        points = self._commit_points(partitions)
        if not points:
            return
        try:
            await self._consumer.commit(self._with_metadata(points))
        except (CommitFailedError, KafkaError) as e:
            log.warning("commit of %s failed (%r); the next owner re-reads from the last commit", _plain(points), e)
            return
        self.tracker.committed(points)
        self._stats.commits += 1

    async def _commit_transaction(self, partitions: set[TopicPartition] | None) -> None:
        producer = self._producer
        async with self._txn_lock:
            points = self._commit_points(partitions)
            if not points:
                return
            if why := self._guard.stale(self._guard.generation):
                self._stats.transactions_self_fenced += 1
                log.warning(
                    "%s commit of %s skipped, the next owner re-reads from the last commit: %s",
                    SELF_FENCED,
                    _plain(points),
                    why,
                )
                return
            try:
                async with producer.transaction():
                    await producer.send_offsets_to_transaction(self._with_metadata(points), self._group_id)
            except TxnOffsetsRefused as refused:
                self._refused(refused)
                return
            self.tracker.committed(points)
