"""Where a consumer group stands on the broker: its size, its committed offsets, and the offsets it
must reach to be caught up with a topic."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, client_options, stable_group_size
from pipeline.tools.harness.errors import HarnessError


def consumer_group(settings: KafkaSettings, model: str) -> str:
    """The group id the consumers of `model` join."""
    return Topics(settings.topic_prefix).group(model)


async def wait_group(
    settings: KafkaSettings, group: str, members: int, timeout_s: float, *, check: Callable[[], None], poll_s: float
) -> None:
    """Return once `group` is stable with `members` members; `check()` raises if a process died meanwhile."""
    deadline = time.monotonic() + timeout_s
    size = -1
    while time.monotonic() < deadline:
        check()
        size = await stable_group_size(settings, group)
        if size == members:
            return
        await asyncio.sleep(poll_s)
    raise HarnessError(f"consumer group {group} has {size} members, expected {members}, after {timeout_s:.0f} s")


async def wait_share_group(
    settings: KafkaSettings, group: str, consumers: int, timeout_s: float, *, check: Callable[[], None], poll_s: float
) -> None:
    """Return once `consumers` consumers each have a share member with partitions assigned in share
    group `group` (a share group hands a member its partitions on a heartbeat, seconds after it joins)."""
    from pipeline.core.kafka.lag_probe import LagProbe
    from pipeline.core.kafka.share_client import consumer_of

    deadline = time.monotonic() + timeout_s
    ready = 0
    async with LagProbe(settings) as probe:
        while time.monotonic() < deadline:
            check()
            view = await probe.describe_share_group(group)
            ready = len({consumer_of(m.client_id) for m in view.members if m.partitions})
            if ready >= consumers:
                return
            await asyncio.sleep(poll_s)
    raise HarnessError(f"share group {group} has {ready} consumers with partitions, expected {consumers}")


async def admin_client(settings: KafkaSettings) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(request_timeout_ms=10_000, **client_options(settings))
    await admin.start()
    return admin


async def committed_offsets(settings: KafkaSettings, group: str) -> dict[tuple[str, int], int]:
    """{(topic, partition): committed offset} of a group."""
    admin = await admin_client(settings)
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items() if meta.offset >= 0}


async def end_offsets(settings: KafkaSettings, topic: str) -> dict[tuple[str, int], int]:
    """{(topic, partition): offset after its last data record} of every partition of `topic`
    (the log end, unless transaction markers end the log)."""
    admin = await admin_client(settings)
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    partitions = sorted(p["partition"] for t in described if t["error_code"] == 0 for p in t["partitions"])
    if not partitions:
        raise HarnessError(f"topic {topic} does not exist (yet)")
    consumer = AIOKafkaConsumer(group_id=None, request_timeout_ms=10_000, **client_options(settings))
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in partitions]
        ends = await consumer.end_offsets(tps)
        data_ends = await _last_data_offsets(consumer, ends)
    finally:
        await consumer.stop()
    return {(tp.topic, tp.partition): offset for tp, offset in data_ends.items()}


DATA_LOOKBACK = 64
"""How far below a partition's end `_last_data_offsets` looks for its last record."""


async def _last_data_offsets(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
    """Offset after each partition's last data record, which is below the log end when the log
    ends in transaction markers (a transactional producer wrote it). A consumer never sees a
    marker, so a caught-up consumer commits this offset, not the end; waiting for the end would
    wait forever. The last DATA_LOOKBACK offsets are read to find it (the end if none is there)."""
    wanted = {tp: end for tp, end in ends.items() if end > 0}
    found = dict(ends)
    if not wanted:
        return found
    consumer.assign(list(wanted))
    starts = await consumer.beginning_offsets(list(wanted))
    last: dict[TopicPartition, int] = {}
    for tp, end in wanted.items():
        consumer.seek(tp, max(end - DATA_LOOKBACK, starts.get(tp, 0)))
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        batches = await consumer.getmany(timeout_ms=200)
        for tp, records in batches.items():
            for record in records:
                if record.offset < wanted[tp]:
                    last[tp] = record.offset + 1
        positions = {tp: await consumer.position(tp) for tp in wanted}
        if all(positions[tp] >= end for tp, end in wanted.items()):
            break
    for tp, end in wanted.items():
        found[tp] = last.get(tp, end)
    return found
