"""Producing many records at once: one record batch per partition, one future per batch.

`AIOKafkaProducer.send()` costs tens of microseconds of Python per record
(metadata check, partitioner, accumulator bookkeeping, a future each). A
consumer answering thousands of requests a second produces two or three
records per request, so that overhead alone would cap the pipeline. Here the
records of one publish are grouped by partition and appended to aiokafka's
`BatchBuilder`s, and only the batches are awaited.

Publishes are also coalesced: callers hand their records to one flusher
task, which sends everything that queued up while the previous flush was on
the wire. aiokafka accepts only one undrained batch per partition, so
concurrent `send_batch` calls would queue behind each other anyway; one
flusher turns that queue into bigger batches, one broker round trip each.

Failures are reported per record, never raised: a batch the broker refuses
as too large is sent again one record per batch, so a single oversized
record fails alone, and the caller (`consumers.delivery`) decides what each
failed record becomes. No batch grows past its topic's `max.message.bytes`.

Partitioning: records of keyed topics (results, reply topics, forwards) go to
the partition Kafka's Java default partitioner would pick for the key
(murmur2), so every client agrees where a request id's answer lives. Records
of the event and dead-letter topics are spread: all records of one publish go
to one partition, rotating, which keeps them in one batch.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError, RecordListTooLargeError
from aiokafka.partitioner import murmur2

from pipeline.core.kafka.topic_limits import TopicLimits, record_size

BATCH_BYTES = 256 * 1024
"""Largest record batch the outbox builds (a single larger record still goes, alone)."""


@dataclass(slots=True, eq=False)
class Message:
    """One record to produce, and how to rebuild it when the broker will not take it as it is."""

    topic: str
    key: bytes | None
    value: bytes
    headers: Sequence[tuple[str, bytes]] | None = None
    fit: Callable[[int], Message] | None = None
    """The same answer rebuilt to take at most this many bytes (dead letters cut the original)."""
    reroute: Callable[[str], Message] | None = None
    """For a client's reply topic: the answer on the model's results topic, saying why."""
    partition: int | None = None
    """Where it must go (a forward to the partition a chosen peer owns); None: by key, or spread."""
    revise: Callable[[], Message] | None = None
    """A record that describes other records of the same publish (a request's latency event, which
    says what its answer became): the record as it stands now. Sent after the others are accepted."""

    @property
    def size(self) -> int:
        return record_size(self.key, self.value, self.headers)


Failure = tuple[Message, BaseException]


def too_large(error: BaseException) -> bool:
    return isinstance(error, (MessageSizeTooLargeError, RecordListTooLargeError))


class Outbox:
    def __init__(self, producer: AIOKafkaProducer, spread_topics: set[str], limits: TopicLimits) -> None:
        self._producer = producer
        self._spread = spread_topics
        self._limits = limits
        self._rotation = itertools.count()
        self._partitions: dict[str, list[int]] = {}
        self._queued: list[tuple[Sequence[Message], asyncio.Future[list[Failure]]]] = []
        self._wakeup = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="outbox")

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            try:
                await self._flusher
            except asyncio.CancelledError:
                pass
        for _, future in self._queued:
            if not future.done():
                future.set_exception(RuntimeError("outbox stopped before the records were sent"))
        self._queued = []

    async def publish(self, messages: Sequence[Message]) -> list[Failure]:
        """Queue `messages` for the next flush; return, once the broker answered, those it refused."""
        if not messages:
            return []
        future: asyncio.Future[list[Failure]] = asyncio.get_running_loop().create_future()
        self._queued.append((messages, future))
        self._wakeup.set()
        return await future

    async def _flush_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            queued, self._queued = self._queued, []
            if not queued:
                continue
            try:
                errors = await self.send_all([m for messages, _ in queued for m in messages])
            except Exception as error:
                errors = [error] * sum(len(messages) for messages, _ in queued)
            start = 0
            for messages, future in queued:
                mine = errors[start : start + len(messages)]
                start += len(messages)
                if not future.done():
                    future.set_result([(m, e) for m, e in zip(messages, mine, strict=True) if e is not None])

    async def _partitions_of(self, topic: str) -> list[int]:
        known = self._partitions.get(topic)
        if known is None:
            known = self._partitions[topic] = sorted(await self._producer.partitions_for(topic))
        return known

    async def send_all(self, messages: Sequence[Message], *, one_per_batch: bool = False) -> list[BaseException | None]:
        """Produce every message; the error of each one the broker refused (None where it took it)."""
        errors: list[BaseException | None] = [None] * len(messages)
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        turn = next(self._rotation)
        for index, message in enumerate(messages):
            topic, key = message.topic, message.key
            try:
                partitions = await self._partitions_of(topic)
            except Exception as error:
                errors[index] = error
                continue
            if message.partition is not None:
                partition = message.partition
            elif topic in self._spread or key is None:
                partition = partitions[turn % len(partitions)]
            else:
                partition = partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]
            groups[(topic, partition)].append(index)
        sent: list[tuple[list[int], asyncio.Future[object]]] = []
        for (topic, partition), indexes in groups.items():
            budget = 0 if one_per_batch else min(BATCH_BYTES, await self._limits.limit(topic))
            for members in self._batches(messages, indexes, budget):
                try:
                    sent.append((members, await self._send(messages, members, topic, partition)))
                except Exception as error:
                    for index in members:
                        errors[index] = error
        outcomes = await asyncio.gather(*(future for _, future in sent), return_exceptions=True)
        alone: list[int] = []
        for (members, _), outcome in zip(sent, outcomes, strict=True):
            if not isinstance(outcome, BaseException):
                continue
            if len(members) > 1 and too_large(outcome):
                alone.extend(members)
            else:
                for index in members:
                    errors[index] = outcome
        if alone:
            retried = await self.send_all([messages[i] for i in alone], one_per_batch=True)
            for index, retry_error in zip(alone, retried, strict=True):
                errors[index] = retry_error
        return errors

    @staticmethod
    def _batches(messages: Sequence[Message], indexes: list[int], budget: int) -> list[list[int]]:
        """Consecutive records grouped so that no group is larger than `budget` (a bigger record goes alone)."""
        out: list[list[int]] = []
        members: list[int] = []
        used = 0
        for index in indexes:
            size = messages[index].size
            if members and used + size > budget:
                out.append(members)
                members, used = [], 0
            members.append(index)
            used += size
        if members:
            out.append(members)
        return out

    async def _send(
        self, messages: Sequence[Message], members: list[int], topic: str, partition: int
    ) -> asyncio.Future[object]:
        producer = self._producer
        batch = producer.create_batch()
        for index in members:
            m = messages[index]
            if batch.append(key=m.key, value=m.value, timestamp=None, headers=list(m.headers or ())) is None:
                raise RecordListTooLargeError("record batch builder refused a record")
        delivered: asyncio.Future[object] = await producer.send_batch(batch, topic, partition=partition)
        return delivered
