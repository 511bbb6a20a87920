"""OffsetFetch v7 with `require_stable` (KIP-447), which aiokafka 0.14 does not speak (it stops at v3).

A transactional commit's offsets are pending at the group coordinator until
the transaction's end marker is written. An OffsetFetch below v7 answers
with the offset committed before it, so a new owner of the partition would
start from an older commit point than the one the transaction is about to
make true. With `require_stable` the coordinator answers such a partition
with UNSTABLE_OFFSET_COMMIT (88) instead, and the caller asks again
(`consumers.stable_start`). Flexible version: compact strings and arrays,
tagged fields, request header v2 (aiokafka's Struct types do the encoding).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from aiokafka.client import ConnectionGroup
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Boolean, CompactArray, CompactString, Int16, Int32, Int64, Schema, TaggedFields

UNSTABLE_OFFSET_COMMIT = 88
"""Partition error: a transaction carrying offsets for it is still open."""
NO_OFFSET = -1


class OffsetFetchResponse_v7(Response):
    API_KEY = 9
    API_VERSION = 7
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition_index", Int32),
                        ("committed_offset", Int64),
                        ("committed_leader_epoch", Int32),
                        ("metadata", CompactString("utf-8")),
                        ("error_code", Int16),
                        ("tags", TaggedFields),
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("error_code", Int16),
        ("tags", TaggedFields),
    )


class OffsetFetchRequest_v7(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 9
    API_VERSION = 7
    RESPONSE_TYPE = OffsetFetchResponse_v7
    SCHEMA = Schema(
        ("group_id", CompactString("utf-8")),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("partition_indexes", CompactArray(Int32)),
                ("tags", TaggedFields),
            ),
        ),
        ("require_stable", Boolean),
        ("tags", TaggedFields),
    )


class StableOffsetFetch(Request[OffsetFetchRequest_v7]):
    """Only v7: a broker without it (Kafka < 2.5) refuses the request as an unsupported version."""

    API_KEY = 9

    def __init__(self, group_id: str, partitions: list[TopicPartition], require_stable: bool = True) -> None:
        by_topic: dict[str, list[int]] = defaultdict(list)
        for tp in partitions:
            by_topic[tp.topic].append(tp.partition)
        self._args: tuple[object, ...] = (
            group_id,
            [(topic, sorted(ps), {}) for topic, ps in sorted(by_topic.items())],
            require_stable,
            {},
        )

    def build(self, request_struct_class: type[OffsetFetchRequest_v7]) -> OffsetFetchRequest_v7:
        return request_struct_class(*self._args)


@dataclass(frozen=True, slots=True)
class Committed:
    """One partition's answer: its committed offset (NO_OFFSET if none) and metadata, or an error code."""

    offset: int
    metadata: str
    error: int = 0


def parse(response: Any) -> tuple[int, dict[TopicPartition, Committed]]:
    """(group error code, each partition's answer) of an OffsetFetch v7 response."""
    out: dict[TopicPartition, Committed] = {}
    for topic, partitions, _ in response.topics:
        for partition, offset, _epoch, metadata, error, _ in partitions:
            out[TopicPartition(topic, partition)] = Committed(offset, metadata or "", error)
    return response.error_code, out


async def fetch_committed(
    client: Any, node_id: int, group_id: str, partitions: list[TopicPartition], *, require_stable: bool = True
) -> tuple[int, dict[TopicPartition, Committed]]:
    """Ask the group coordinator `node_id` through aiokafka's `client` (its coordination connection)."""
    response = await client.send(
        node_id, StableOffsetFetch(group_id, partitions, require_stable), group=ConnectionGroup.COORDINATION
    )
    return parse(response)
