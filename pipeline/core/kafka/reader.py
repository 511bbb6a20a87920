"""The one reader of the output topics (results, dead letters, events), for everyone who is not the sink.

Benches, chaos, the demo, `batchtide results` and the tests all read answers
the same way: from the start of the topics, without a consumer group (nothing
committed, unless a group is asked for), `read_committed` so that a
transactional consumer's aborted answers are never counted. What differs is
only when to stop, so that is what `read` takes as parameters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeAlias

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options, stop_client

Record: TypeAlias = ConsumerRecord[bytes, bytes]
Isolation = Literal["read_committed", "read_uncommitted"]


class TopicReader:
    """Reads topics from the beginning (or from the end) and hands every record to a callback.

    Use as `async with TopicReader(settings, topic) as reader: await reader.read(...)`.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        topics: str | Iterable[str],
        *,
        isolation_level: Isolation = "read_committed",
        from_beginning: bool = True,
        since_ms: int | None = None,
        group_id: str | None = None,
        **options: Any,
    ) -> None:
        """`since_ms`: start each partition at its first record written at or after this time
        (epoch ms; a partition with none starts at its end) instead of the beginning or end."""
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        self._group_id = group_id
        self._since_ms = since_ms
        self._consumer = AIOKafkaConsumer(
            *self.topics,
            **client_options(settings),
            group_id=group_id,
            auto_offset_reset="earliest" if from_beginning else "latest",
            enable_auto_commit=False,
            isolation_level=isolation_level,
            **options,
        )
        self.count = 0
        """Records handed out so far."""

    async def start(self) -> None:
        try:
            await self._consumer.start()
        except BaseException:
            # A start() that fails (a topic a broker does not know yet) leaves the consumer's
            # fetch and metadata tasks running, and asyncio.run() then waits for them forever.
            await self._consumer.stop()
            raise
        if self._since_ms is not None:
            partitions = list(await self._assignment(30.0))
            found = await self._consumer.offsets_for_times(dict.fromkeys(partitions, self._since_ms))
            ends = await self._consumer.end_offsets(partitions)
            for tp in partitions:
                at = found.get(tp)
                self._consumer.seek(tp, at.offset if at is not None else ends[tp])

    async def _assignment(self, timeout_s: float) -> set[Any]:
        """The partitions of the topics, once the background metadata fetch has assigned them."""
        deadline = time.monotonic() + timeout_s
        partitions: set[Any] = self._consumer.assignment()
        while not partitions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            partitions = self._consumer.assignment()
        return partitions

    async def stop(self) -> None:
        await stop_client(self._consumer.stop, "a topic reader")

    async def __aenter__(self) -> TopicReader:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def read(
        self,
        on_record: Callable[[Record], object],
        *,
        until: Callable[[], bool] | None = None,
        timeout_s: float | None = None,
        grace_s: float = 0.0,
        idle_s: float | None = None,
        limit: int | None = None,
        poll_ms: int = 100,
    ) -> bool:
        """Hand records to `on_record` until a stop condition holds; True when `until` (or `limit`) was met.

        Stops when `until()` has held for `grace_s` (late duplicates still
        arrive in the grace), when `limit` records were read (never fetching
        beyond it, so a group commit leaves the rest for the next reader),
        after `idle_s` without a record, or at `timeout_s`. With no condition
        at all it reads until cancelled (a background collector).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        met_at: float | None = None
        last_record = time.monotonic()
        read_here = 0
        while True:
            now = time.monotonic()
            if met_at is None and ((until is not None and until()) or (limit is not None and read_here >= limit)):
                met_at = now
            if met_at is not None and (now - met_at >= grace_s or (limit is not None and read_here >= limit)):
                return True
            if deadline is not None and now >= deadline:
                return False
            if idle_s is not None and now - last_record >= idle_s:
                return False
            wait_ms = poll_ms if deadline is None else max(1, min(poll_ms, int((deadline - now) * 1000)))
            room = None if limit is None else limit - read_here
            batch = await self._consumer.getmany(timeout_ms=wait_ms, max_records=room)
            for records in batch.values():
                for record in records:
                    on_record(record)
                    read_here += 1
                    self.count += 1
                    last_record = time.monotonic()

    async def read_to_end(self, on_record: Callable[[Record], object], *, timeout_s: float = 30.0) -> bool:
        """Hand out every record up to the end offsets as they are now (the last stable offset when
        reading committed); True when the end was reached within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        partitions = await self._assignment(timeout_s)
        ends = await self._consumer.end_offsets(list(partitions))
        while time.monotonic() < deadline:
            positions = {tp: await self._consumer.position(tp) for tp in ends}
            if all(positions[tp] >= end for tp, end in ends.items()):
                return True
            for records in (await self._consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    on_record(record)
                    self.count += 1
        return False

    async def commit(self) -> None:
        """Commit the positions read so far (only with a `group_id`): the next reader of the group goes on from here."""
        if self._group_id is None:
            raise ValueError("a reader without a group_id has nothing to commit")
        await self._consumer.commit()
