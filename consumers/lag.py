"""Each consumer's own lag sample: its partitions' lag and lag age, and its engine's state.

`LagRecorder` runs beside each consumer and publishes a `LagEvent` every
`lag_interval_ms` to `<prefix>.events.lag` (the sink loads it into
ClickHouse `consumer_lag` with source = 'consumer'). Lag and lag age come
from the broker (`pipeline.core.kafka.lag_probe.LagProbe`: committed against end
offsets, and the CreateTime of the record at the committed offset); the
commit trails the answers by up to `commit_interval_ms`, which is the whole
error. A model whose consumers are all gone records nothing here: the sink
samples every group from the broker as well (pipeline/core/store/group_lag.py).
`batchtide status` reads the latest event of each consumer from the topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Protocol

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, client_options, durable_producer, stop_client
from pipeline.core.kafka.lag_probe import PROBE_TIMEOUT_MS, GroupView, LagProbe, Member
from schemas.messages import LagEvent, PartitionLag

__all__ = ["GroupView", "LagProbe", "LagRecorder", "Member", "lag_recorder", "latest_lag_events"]

log = logging.getLogger("batchtide.lag")
_encode = msgspec.json.Encoder().encode
BATCH_WATCH_S = 0.5
"""How often the recorder notices a new batch (last batch time is known to within this)."""


class RecordedConsumer(Protocol):
    """What the recorder reads from a running consumer (consumers.worker.Consumer); its
    partitions come from the group coordinator, where the member's client id is the consumer id."""

    model: Any
    consumer_id: str
    group_id: str
    engine: Any
    stats: Any

    def beacon(self) -> Any: ...


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
            except Exception as e:
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
            rows: list[PartitionLag] = []
            if not getattr(self.consumer, "share", False):
                # a share group's partitions are everyone's: its lag is the group's, sampled by the sink
                group = await probe.describe_group(self.consumer.group_id)
                mine = [m for m in group.members if m.client_id == self.consumer.consumer_id]
                partitions = sorted({tp for m in mine for tp in m.partitions})
                rows = await probe.measure(self.consumer.group_id, partitions)
            event = self.event(rows)
            await producer.send_and_wait(self.topic, _encode(event), key=self.consumer.consumer_id.encode())
        except Exception as e:
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
            capacity_per_s=c.beacon().capacity_per_s,
        )


def lag_recorder(consumer: RecordedConsumer, settings: KafkaSettings, interval_ms: float) -> LagRecorder | None:
    """The recorder for a consumer, built with it and started once it has joined its group;
    None when lag recording is off."""
    if interval_ms <= 0:
        return None
    return LagRecorder(consumer, settings, interval_ms / 1000.0)


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
