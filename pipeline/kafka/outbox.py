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
from collections.abc import Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2

Message = tuple[str, bytes | None, bytes, Sequence[tuple[str, bytes]] | None]
"""(topic, key, value, headers) of one record to produce."""


class Outbox:
    def __init__(self, producer: AIOKafkaProducer, spread_topics: set[str]) -> None:
        self._producer = producer
        self._spread = spread_topics
        self._rotation = itertools.count()
        self._partitions: dict[str, list[int]] = {}
        self._queued: list[tuple[Sequence[Message], asyncio.Future[None]]] = []
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

    async def publish(self, messages: Sequence[Message]) -> None:
        """Queue `messages` for the next flush; return once the broker acknowledged them."""
        if not messages:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append((messages, future))
        self._wakeup.set()
        await future

    async def _flush_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            queued, self._queued = self._queued, []
            if not queued:
                continue
            try:
                await self.send_all([m for messages, _ in queued for m in messages])
            except Exception as error:  # noqa: BLE001 - every waiting publisher gets the failure
                for _, future in queued:
                    if not future.done():
                        future.set_exception(error)
            else:
                for _, future in queued:
                    if not future.done():
                        future.set_result(None)

    async def _partitions_of(self, topic: str) -> list[int]:
        known = self._partitions.get(topic)
        if known is None:
            known = self._partitions[topic] = sorted(await self._producer.partitions_for(topic))
        return known

    async def send_all(self, messages: Sequence[Message]) -> None:
        """Produce every message and return once the broker acknowledged all of them."""
        groups: dict[tuple[str, int], list[Message]] = defaultdict(list)
        turn = next(self._rotation)
        for message in messages:
            topic, key = message[0], message[1]
            partitions = await self._partitions_of(topic)
            if topic in self._spread or key is None:
                partition = partitions[turn % len(partitions)]
            else:
                partition = partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]
            groups[(topic, partition)].append(message)
        futures = []
        producer = self._producer
        for (topic, partition), group in groups.items():
            batch = producer.create_batch()
            for _, key, value, headers in group:
                if batch.append(key=key, value=value, timestamp=None, headers=list(headers or ())) is None:
                    futures.append(await producer.send_batch(batch, topic, partition=partition))
                    batch = producer.create_batch()
                    batch.append(key=key, value=value, timestamp=None, headers=list(headers or ()))
            futures.append(await producer.send_batch(batch, topic, partition=partition))
        await asyncio.gather(*futures)
