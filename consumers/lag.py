"""Consumer lag as a Kafka operator reads it: records behind, and how old the oldest one is.

Per partition of a model's request topics: end offset minus the group's
committed offset (Burrow's measure: committed offsets against the log end,
not the fetch position, because only a commit means "answered"), and the
age of the oldest record not yet answered (kafka-lag-exporter's lag in
time). That age is not interpolated from offset history: the consumer
commits only up to its first unanswered record (pipeline/kafka/offsets.py), so
the record at the committed offset *is* the oldest unanswered one, and its
CreateTime is read. The commit trails the answers by up to
`commit_interval_ms`, which is the whole error.

`LagRecorder` runs beside each consumer and publishes a `LagEvent` every
`lag_interval_ms` to `<prefix>.events.lag` (the sink loads it into
ClickHouse `consumer_lag`); `batchtide status` calls `measure_lag` and
`describe_group` directly for the live view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import CoordinatorLoadInProgressError, GroupCoordinatorNotAvailableError, NotCoordinatorError

from pipeline.kafka.client import Topics, client_options, durable_producer, stop_client
from pipeline.config import KafkaSettings
from schemas.messages import LagEvent, PartitionLag

log = logging.getLogger("batchtide.lag")
_encode = msgspec.json.Encoder().encode
BATCH_WATCH_S = 0.5
"""How often the recorder notices a new batch (last batch time is known to within this)."""
PROBE_TIMEOUT_MS = 2000
COORDINATOR_WAIT_S = 10.0
T = TypeVar("T")


@dataclass(frozen=True)
class Member:
    """One member of a consumer group and what it was assigned."""

    member_id: str
    client_id: str
    host: str
    partitions: tuple[TopicPartition, ...]


@dataclass(frozen=True)
class GroupView:
    state: str
    members: tuple[Member, ...]


async def _coordinated(call: Callable[[], Awaitable[T]], timeout_s: float = COORDINATOR_WAIT_S) -> T:
    """`call`, retried while the group's coordinator is not ready (a new group or a fresh
    broker has none for a moment); other errors and a coordinator that never comes raise."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except (GroupCoordinatorNotAvailableError, CoordinatorLoadInProgressError, NotCoordinatorError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


class LagProbe:
    """Admin client plus a group-less consumer: committed offsets, end offsets and the
    CreateTime of the record at a committed offset, without joining the group."""

    def __init__(self, settings: KafkaSettings) -> None:
        options = client_options(settings)
        self._admin = AIOKafkaAdminClient(request_timeout_ms=10_000, **options)
        self._reader = AIOKafkaConsumer(
            **options, group_id=None, enable_auto_commit=False, max_partition_fetch_bytes=64 * 1024
        )  # one record is wanted; the broker still returns a first record batch larger than this

    async def __aenter__(self) -> "LagProbe":
        await self._admin.start()
        await self._reader.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._reader.stop()
        await self._admin.close()

    async def describe_group(self, group: str) -> GroupView:
        """The group's state and each member's assigned partitions, as the coordinator has them."""
        responses = await _coordinated(lambda: self._admin.describe_consumer_groups([group]))
        for response in responses:
            for description in response.groups:
                error_code, state, members = description[0], description[2], description[5]
                if error_code != 0:
                    continue
                found = []
                for member_id, client_id, host, _metadata, assignment in members:
                    parts: tuple[TopicPartition, ...] = ()
                    if assignment:
                        decoded = ConsumerProtocolMemberAssignment.decode(assignment)
                        parts = tuple(sorted(decoded.partitions()))
                    found.append(Member(member_id, client_id, host, parts))
                return GroupView(state, tuple(sorted(found, key=lambda m: m.client_id)))
        return GroupView("Unknown", ())

    async def topic_partitions(self, topics: list[str]) -> list[TopicPartition]:
        """Every partition of `topics`, in the order given (missing topics have none)."""
        described = {t["topic"]: t for t in await self._admin.describe_topics(topics) if t["error_code"] == 0}
        return [
            TopicPartition(topic, p["partition"])
            for topic in topics
            for p in sorted(described.get(topic, {}).get("partitions", []), key=lambda p: p["partition"])
        ]

    async def measure(self, group: str, partitions: list[TopicPartition], now_ms: float | None = None) -> list[PartitionLag]:
        """Lag and lag age of `partitions` for `group`, in the order given."""
        if not partitions:
            return []
        committed = await _coordinated(lambda: self._admin.list_consumer_group_offsets(group, partitions=partitions))
        ends = await self._reader.end_offsets(partitions)
        starts = await self._reader.beginning_offsets(partitions)
        now = time.time() * 1000.0 if now_ms is None else now_ms
        out: list[PartitionLag] = []
        for tp in partitions:
            meta = committed.get(tp)
            offset = meta.offset if meta is not None and meta.offset >= 0 else -1
            first_unanswered = max(offset, starts.get(tp, 0))
            end = ends.get(tp, 0)
            lag = max(end - first_unanswered, 0)
            oldest = await self._create_time(tp, first_unanswered) if lag else 0
            age = max(now - oldest, 0.0) if oldest else 0.0
            out.append(PartitionLag(tp.topic, tp.partition, end, offset, lag, oldest, age))
        return out

    async def _create_time(self, tp: TopicPartition, offset: int) -> int:
        """CreateTime of the first record at or after `offset` (0 if none arrives in time)."""
        reader = self._reader
        reader.assign([tp])
        reader.seek(tp, offset)
        got = await reader.getmany(tp, timeout_ms=PROBE_TIMEOUT_MS, max_records=1)
        for record in got.get(tp, []):
            return int(record.timestamp)
        return 0


class RecordedConsumer(Protocol):
    """What the recorder reads from a running consumer (consumers.worker.Consumer); its
    partitions come from the group coordinator, where the member's client id is the consumer id."""

    model: Any
    consumer_id: str
    group_id: str
    engine: Any
    stats: Any


class LagRecorder:
    """Publishes a LagEvent for one consumer every `interval_s` until stopped."""

    def __init__(self, consumer: RecordedConsumer, settings: KafkaSettings, interval_s: float) -> None:
        self.consumer = consumer
        self.settings = settings
        self.interval_s = interval_s
        self.topic = Topics(settings.topic_prefix).lag_events
        self.sent = 0
        self.last: LagEvent | None = None
        self._batches_seen = 0
        self._last_batch_ms = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lag-recorder")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _watch_batches(self) -> None:
        batches = self.consumer.stats.batches
        if batches != self._batches_seen:
            self._batches_seen = batches
            self._last_batch_ms = int(time.time() * 1000)

    async def _run(self) -> None:
        """Sample forever; clients that fail (a broker outage at start) are rebuilt after an interval."""
        while True:
            try:
                await self._session()
            except Exception as e:  # noqa: BLE001 - recording lag must never end while the consumer serves
                log.warning("lag recorder of %s restarting after %r", self.consumer.consumer_id, e)
                await asyncio.sleep(self.interval_s)

    async def _session(self) -> None:
        producer = AIOKafkaProducer(**client_options(self.settings), **durable_producer(), linger_ms=0)
        await producer.start()
        try:
            async with LagProbe(self.settings) as probe:
                next_sample = time.monotonic()
                while True:
                    self._watch_batches()
                    if time.monotonic() >= next_sample:
                        next_sample = max(next_sample + self.interval_s, time.monotonic())
                        await self._sample(probe, producer)
                    await asyncio.sleep(min(BATCH_WATCH_S, max(next_sample - time.monotonic(), 0.0)))
        finally:
            # a lag sample lost at shutdown costs nothing; a stopping consumer must not wait for it
            await stop_client(producer.stop, f"lag recorder of {self.consumer.consumer_id}: its producer", 2.0)

    async def _sample(self, probe: LagProbe, producer: AIOKafkaProducer) -> None:
        try:
            group = await probe.describe_group(self.consumer.group_id)
            mine = [m for m in group.members if m.client_id == self.consumer.consumer_id]
            partitions = sorted({tp for m in mine for tp in m.partitions})
            rows = await probe.measure(self.consumer.group_id, partitions)
            event = self.event(rows)
            await producer.send_and_wait(self.topic, _encode(event), key=self.consumer.consumer_id.encode())
        except Exception as e:  # noqa: BLE001 - a failed sample costs one sample, never the recorder or the consumer
            log.warning("lag sample of %s skipped: %r", self.consumer.consumer_id, e)
            return
        self.last = event
        self.sent += 1

    def event(self, partitions: list[PartitionLag]) -> LagEvent:
        c = self.consumer
        state = c.engine.stats()
        return LagEvent(
            ts_ms=int(time.time() * 1000),
            model=c.model.name,
            consumer_id=c.consumer_id,
            group=c.group_id,
            partitions=partitions,
            queue=int(state["pending"]),
            inflight=int(state["inflight"]),
            window_ms=float(state["window_ms"]),
            effective_cap=int(state["effective_cap"]),
            cap_reason=str(state["cap_reason"]),
            marked_share=float(state["marked_share"]),
            arrival_rate_per_s=float(state["arrival_rate_per_s"]),
            batches=int(c.stats.batches),
            last_batch_ms=self._last_batch_ms,
            dead_letters=int(c.stats.dead_letters),
        )


def start_recorder(consumer: RecordedConsumer, settings: KafkaSettings, interval_ms: float) -> LagRecorder | None:
    """The recorder for a consumer that has joined its group; None when lag recording is off."""
    if interval_ms <= 0:
        return None
    recorder = LagRecorder(consumer, settings, interval_ms / 1000.0)
    recorder.start()
    return recorder


async def latest_lag_events(settings: KafkaSettings, max_age_ms: float, tail: int = 200) -> dict[str, LagEvent]:
    """The newest LagEvent of each consumer written in the last `max_age_ms`, read from the
    end of `<prefix>.events.lag` (at most `tail` records per partition)."""
    topic = Topics(settings.topic_prefix).lag_events
    reader = AIOKafkaConsumer(**client_options(settings), group_id=None, enable_auto_commit=False)
    decoder = msgspec.json.Decoder(LagEvent)
    newest: dict[str, LagEvent] = {}
    async with LagProbe(settings) as probe:
        partitions = await probe.topic_partitions([topic])
    await reader.start()
    try:
        if not partitions:
            return {}
        reader.assign(partitions)
        ends = await reader.end_offsets(partitions)
        starts = await reader.beginning_offsets(partitions)
        for tp in partitions:
            reader.seek(tp, max(ends[tp] - tail, starts[tp]))
        cutoff = time.time() * 1000.0 - max_age_ms
        while any([await reader.position(tp) < ends[tp] for tp in partitions]):
            got = await reader.getmany(timeout_ms=PROBE_TIMEOUT_MS)
            if not got:
                break
            for records in got.values():
                for record in records:
                    try:
                        event = decoder.decode(record.value or b"")
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    known = newest.get(event.consumer_id)
                    if event.ts_ms >= cutoff and (known is None or event.ts_ms > known.ts_ms):
                        newest[event.consumer_id] = event
    finally:
        await reader.stop()
    return newest
