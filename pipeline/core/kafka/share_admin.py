"""A share group as the broker sees it: its progress (DescribeShareGroupOffsets, KIP-932, lag from
KIP-1226) and its members (ShareGroupDescribe).

A share group has no committed offsets. Per partition the broker keeps the
share-partition start offset (SPSO): every record before it is acknowledged,
records from it on are available, acquired or already acknowledged out of
order. From Kafka 4.2 (request v1) it also reports the partition's lag: the
records from the SPSO to the log end not yet acknowledged. The record at the
SPSO is the oldest one not acknowledged, so its CreateTime is the lag age,
as a partition group's committed offset gives it (`lag_probe.LagProbe`).

What the broker does not say: how many of the lagging records are acquired
(in flight on some member) and how many wait, nor which member holds which.
And the start offset it reports is the share coordinator's last persisted
state, which trails the acknowledgements (measured here: 63 where 363
records had all been acknowledged, with the lag already 0), so the lag age
read at it is an upper bound; the lag itself is current.

Neither aiokafka nor confluent-kafka's Python admin client (2.16) sends these
requests, so they are built here with aiokafka's protocol types, like
`txn_offset_commit`, and sent to the group's coordinator: flexible versions
(compact strings and arrays, tagged fields). DescribeShareGroupOffsets is
API key 90, v1 where the broker has it (4.2+) and v0 otherwise (no lag);
ShareGroupDescribe is API key 77, v1 (the only version Kafka 4.x takes).
"""

from __future__ import annotations

from dataclasses import dataclass
from io import BytesIO
from typing import Any

from aiokafka import TopicPartition
from aiokafka.client import AIOKafkaClient, CoordinationType
from aiokafka.errors import for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    AbstractType,
    Boolean,
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Int64,
    Schema,
    TaggedFields,
)

API_KEY = 90
UNKNOWN_LAG = -1


@dataclass(frozen=True, slots=True)
class ShareOffset:
    """One share partition's progress."""

    start_offset: int
    """The share-partition start offset as the share coordinator last persisted it: every record before
    it is acknowledged (-1: nothing persisted yet). It trails the acknowledgements: the broker persists
    its share state in batches, so right after a burst it can name a record acknowledged long since."""
    lag: int | None
    """Records from the start offset on not yet acknowledged (None: the broker did not say)."""


class _Uuid(AbstractType[bytes]):
    """Kafka's uuid: 16 raw bytes (a topic id; aiokafka has no such type)."""

    @classmethod
    def encode(cls, value: bytes) -> bytes:
        return value

    @classmethod
    def decode(cls, data: BytesIO) -> bytes:
        return data.read(16)


def _partition(version: int) -> Any:
    return CompactArray(
        ("partition_index", Int32),
        ("start_offset", Int64),
        ("leader_epoch", Int32),
        *((("lag", Int64),) if version >= 1 else ()),
        ("error_code", Int16),
        ("error_message", CompactString("utf-8")),
        ("tags", TaggedFields),
    )


def _response_schema(version: int) -> Schema:
    return Schema(
        ("throttle_time_ms", Int32),
        (
            "groups",
            CompactArray(
                ("group_id", CompactString("utf-8")),
                (
                    "topics",
                    CompactArray(
                        ("topic_name", CompactString("utf-8")),
                        ("topic_id", _Uuid),
                        ("partitions", _partition(version)),
                        ("tags", TaggedFields),
                    ),
                ),
                ("error_code", Int16),
                ("error_message", CompactString("utf-8")),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


REQUEST_SCHEMA = Schema(
    (
        "groups",
        CompactArray(
            ("group_id", CompactString("utf-8")),
            (
                "topics",
                CompactArray(
                    ("topic_name", CompactString("utf-8")),
                    ("partitions", CompactArray(Int32)),
                    ("tags", TaggedFields),
                ),
            ),
            ("tags", TaggedFields),
        ),
    ),
    ("tags", TaggedFields),
)


class DescribeShareGroupOffsetsResponse_v0(Response):
    API_KEY = API_KEY
    API_VERSION = 0
    SCHEMA = _response_schema(0)


class DescribeShareGroupOffsetsResponse_v1(Response):
    API_KEY = API_KEY
    API_VERSION = 1
    SCHEMA = _response_schema(1)


class DescribeShareGroupOffsetsRequest_v0(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = API_KEY
    API_VERSION = 0
    RESPONSE_TYPE = DescribeShareGroupOffsetsResponse_v0
    SCHEMA = REQUEST_SCHEMA


class DescribeShareGroupOffsetsRequest_v1(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = API_KEY
    API_VERSION = 1
    RESPONSE_TYPE = DescribeShareGroupOffsetsResponse_v1
    SCHEMA = REQUEST_SCHEMA


class DescribeShareGroupOffsets(Request[DescribeShareGroupOffsetsRequest_v0 | DescribeShareGroupOffsetsRequest_v1]):
    """v1 where the broker has it (4.2+: with lag), else v0."""

    API_KEY = API_KEY

    def __init__(self, group: str, partitions: list[TopicPartition]) -> None:
        by_topic: dict[str, list[int]] = {}
        for tp in partitions:
            by_topic.setdefault(tp.topic, []).append(tp.partition)
        self._groups: list[Any] = [(group, [(topic, sorted(parts), {}) for topic, parts in by_topic.items()], {})]

    def build(self, request_struct_class: type[Any]) -> Any:
        return request_struct_class(self._groups, {})


async def describe_share_offsets(
    client: AIOKafkaClient, group: str, partitions: list[TopicPartition]
) -> dict[TopicPartition, ShareOffset]:
    """The share group's start offset (and lag, from Kafka 4.2) of each of `partitions` it has read;
    a partition it never fetched from is left out."""
    if not partitions:
        return {}
    node = await client.coordinator_lookup(CoordinationType.GROUP, group)
    response = await client.send(node, DescribeShareGroupOffsets(group, partitions))
    with_lag = response.API_VERSION >= 1
    out: dict[TopicPartition, ShareOffset] = {}
    for _group_id, topics, error_code, error_message, _tags in response.groups:
        if error_code:
            raise for_code(error_code)(f"describing share group {group}: {error_message or ''}".strip())
        for name, _topic_id, parts, _ in topics:
            for part in parts:
                index, start = part[0], part[1]
                lag = part[3] if with_lag else UNKNOWN_LAG
                error = part[4] if with_lag else part[3]
                if error:
                    continue
                out[TopicPartition(name, index)] = ShareOffset(start, None if lag == UNKNOWN_LAG else lag)
    return out


DESCRIBE_KEY = 77


class _Assignment(AbstractType[Any]):
    """ShareGroupDescribe's member assignment: a struct (topic partitions, tags), not an array."""

    SCHEMA = Schema(
        (
            "topic_partitions",
            CompactArray(
                ("topic_id", _Uuid),
                ("topic_name", CompactString("utf-8")),
                ("partitions", CompactArray(Int32)),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )

    @classmethod
    def encode(cls, value: Any) -> bytes:
        encoded: bytes = cls.SCHEMA.encode(value)
        return encoded

    @classmethod
    def decode(cls, data: BytesIO) -> Any:
        return cls.SCHEMA.decode(data)


class ShareGroupDescribeResponse_v1(Response):
    API_KEY = DESCRIBE_KEY
    API_VERSION = 1
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "groups",
            CompactArray(
                ("error_code", Int16),
                ("error_message", CompactString("utf-8")),
                ("group_id", CompactString("utf-8")),
                ("group_state", CompactString("utf-8")),
                ("group_epoch", Int32),
                ("assignment_epoch", Int32),
                ("assignor_name", CompactString("utf-8")),
                (
                    "members",
                    CompactArray(
                        ("member_id", CompactString("utf-8")),
                        ("rack_id", CompactString("utf-8")),
                        ("member_epoch", Int32),
                        ("client_id", CompactString("utf-8")),
                        ("client_host", CompactString("utf-8")),
                        ("subscribed_topic_names", CompactArray(CompactString("utf-8"))),
                        ("assignment", _Assignment),
                        ("tags", TaggedFields),
                    ),
                ),
                ("authorized_operations", Int32),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class ShareGroupDescribeRequest_v1(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = DESCRIBE_KEY
    API_VERSION = 1
    RESPONSE_TYPE = ShareGroupDescribeResponse_v1
    SCHEMA = Schema(
        ("group_ids", CompactArray(CompactString("utf-8"))),
        ("include_authorized_operations", Boolean),
        ("tags", TaggedFields),
    )


class ShareGroupDescribe(Request[ShareGroupDescribeRequest_v1]):
    API_KEY = DESCRIBE_KEY

    def __init__(self, group: str) -> None:
        self._group = group

    def build(self, request_struct_class: type[Any]) -> Any:
        return request_struct_class([self._group], False, {})


@dataclass(frozen=True, slots=True)
class ShareMemberView:
    """One member of a share group and the partitions the broker assigned it (shared with others)."""

    member_id: str
    client_id: str
    host: str
    partitions: tuple[TopicPartition, ...]


async def describe_share_group(client: AIOKafkaClient, group: str) -> tuple[str, list[ShareMemberView]]:
    """The share group's state (Empty, Stable, Dead...) and its members; ("Dead", []) for a group the
    broker does not know."""
    node = await client.coordinator_lookup(CoordinationType.GROUP, group)
    response = await client.send(node, ShareGroupDescribe(group))
    for described in response.groups:
        error_code, error_message, _group_id, state = described[0], described[1], described[2], described[3]
        if error_code == GROUP_ID_NOT_FOUND:
            return "Dead", []
        if error_code:
            raise for_code(error_code)(f"describing share group {group}: {error_message or ''}".strip())
        members = []
        for member in described[7]:
            assignment = member[6]
            parts = tuple(
                sorted(TopicPartition(topic[1], p) for topic in (assignment[0] or []) for p in (topic[2] or []))
            )
            members.append(ShareMemberView(member[0], member[3], member[4], parts))
        return state, sorted(members, key=lambda m: m.client_id)
    return "Dead", []


GROUP_ID_NOT_FOUND = 69
