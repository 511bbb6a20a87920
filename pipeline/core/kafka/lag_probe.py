"""Consumer-group lag read from the broker: committed offsets, end offsets, members.

Per partition, end offset minus the group's committed offset (Burrow's
measure: committed offsets against the log end, not the fetch position,
because only a commit means "answered"), and the CreateTime of the record at
the committed offset: a batchtide consumer commits only up to its first
unanswered record (pipeline/core/kafka/offsets.py), so that record *is* the
oldest unanswered one, and its age is kafka-lag-exporter's lag in time,
read rather than interpolated from offset history. The probe never joins
the group, so it measures a group with no member left as well as a busy one:
each consumer's recorder (consumers/lag.py), the sink's group sampler
(pipeline/core/store/group_lag.py) and `batchtide status` use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import CoordinatorLoadInProgressError, GroupCoordinatorNotAvailableError, NotCoordinatorError

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options, stop_client
from pipeline.core.kafka.share_admin import describe_share_group, describe_share_offsets
from schemas.messages import PartitionLag

PROBE_TIMEOUT_MS = 2000
"""Longest wait for the record at a committed offset (its CreateTime is the lag age)."""
COORDINATOR_WAIT_S = 10.0
READER_STOP_S = 2.0
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

    async def __aenter__(self) -> LagProbe:
        await self._admin.start()
        await self._reader.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        # bounded: a process that stops while the broker is gone must not wait for it here
        await stop_client(self._reader.stop, "lag probe's reader", READER_STOP_S)
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

    async def describe_share_group(self, group: str) -> GroupView:
        """A share group's state and members (each of a consumer's share members is listed: client ids
        `<consumer id>#<role>`), with the partitions each was assigned (shared with other members)."""
        client = self._admin._client
        state, members = await _coordinated(lambda: describe_share_group(client, group))
        return GroupView(state, tuple(Member(m.member_id, m.client_id, m.host, m.partitions) for m in members))

    async def describe(self, group: str, *, share: bool) -> GroupView:
        return await (self.describe_share_group(group) if share else self.describe_group(group))

    async def lag(self, group: str, partitions: list[TopicPartition], *, share: bool) -> list[PartitionLag]:
        """`measure_share` for a share group, `measure` for a partition group."""
        return await (self.measure_share(group, partitions) if share else self.measure(group, partitions))

    async def group_ids(self, prefix: str) -> list[str]:
        """Every consumer group whose id starts with `prefix`, also those with no member left."""
        listed = await self._admin.list_consumer_groups()
        return sorted({str(entry[0]) for entry in listed if str(entry[0]).startswith(prefix)})

    async def end_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The log end offset of each of `partitions` (no group involved)."""
        return dict(await self._reader.end_offsets(partitions)) if partitions else {}

    async def topic_partitions(self, topics: list[str]) -> list[TopicPartition]:
        """Every partition of `topics`, in the order given (missing topics have none)."""
        described = {t["topic"]: t for t in await self._admin.describe_topics(topics) if t["error_code"] == 0}
        return [
            TopicPartition(topic, p["partition"])
            for topic in topics
            for p in sorted(described.get(topic, {}).get("partitions", []), key=lambda p: p["partition"])
        ]

    async def measure(
        self, group: str, partitions: list[TopicPartition], now_ms: float | None = None
    ) -> list[PartitionLag]:
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

    async def measure_share(
        self, group: str, partitions: list[TopicPartition], now_ms: float | None = None
    ) -> list[PartitionLag]:
        """Lag and lag age of `partitions` for share group `group`, in the order given: from each share
        partition's start offset (every record before it acknowledged) to the log end, the broker's
        own count of records not acknowledged where it gives one (Kafka 4.2+), and the CreateTime of
        the record at the start offset (the oldest one not acknowledged; an upper bound, as the broker
        reports the start offset it last persisted, which trails). A partition the group never read
        starts at the log start (share mode sets `share.auto.offset.reset` to earliest)."""
        if not partitions:
            return []
        client = self._admin._client
        shared = await _coordinated(lambda: describe_share_offsets(client, group, partitions))
        ends = await self._reader.end_offsets(partitions)
        starts = await self._reader.beginning_offsets(partitions)
        now = time.time() * 1000.0 if now_ms is None else now_ms
        out: list[PartitionLag] = []
        for tp in partitions:
            end = ends.get(tp, 0)
            known = shared.get(tp)
            first = max(known.start_offset if known is not None else 0, starts.get(tp, 0))
            lag = known.lag if known is not None and known.lag is not None else max(end - first, 0)
            # the start offset trails the acknowledgements (persisted in batches): no lag, no age
            lag = min(lag, max(end - first, 0))
            oldest = await self._create_time(tp, first) if lag else 0
            age = max(now - oldest, 0.0) if oldest else 0.0
            out.append(PartitionLag(tp.topic, tp.partition, end, first if known is not None else -1, lag, oldest, age))
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
