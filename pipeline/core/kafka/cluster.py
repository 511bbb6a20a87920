"""Who does what in a Kafka cluster: live brokers, the active KRaft controller,
partition leaders and ISR, and the transaction coordinator of a transactional id.

`batchtide local status` shows it and the cluster chaos rows pick their victims
with it. aiokafka has no DescribeQuorum call (a KRaft cluster's metadata names
a random broker as "controller"), so the request is defined here from Kafka's
protocol schema (DescribeQuorum v0, api key 55, a flexible version).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaClient, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.coordination import FindCoordinatorRequest
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.protocol.types import CompactArray, CompactString, Int16, Int32, Int64, Schema, TaggedFields

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options

METADATA_TOPIC = "__cluster_metadata"
GROUP_COORDINATOR, TRANSACTION_COORDINATOR = 0, 1
"""FindCoordinator key types: a consumer group, a transactional id."""


class DescribeQuorumResponse_v0(Response):
    API_KEY = 55
    API_VERSION = 0
    _REPLICA = (("replica_id", Int32), ("log_end_offset", Int64), ("tags", TaggedFields))
    SCHEMA = Schema(
        ("error_code", Int16),
        (
            "topics",
            CompactArray(
                ("topic_name", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition_index", Int32),
                        ("error_code", Int16),
                        ("leader_id", Int32),
                        ("leader_epoch", Int32),
                        ("high_watermark", Int64),
                        ("current_voters", CompactArray(*_REPLICA)),
                        ("observers", CompactArray(*_REPLICA)),
                        ("tags", TaggedFields),
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class DescribeQuorumRequest_v0(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 55
    API_VERSION = 0
    RESPONSE_TYPE = DescribeQuorumResponse_v0
    SCHEMA = Schema(
        (
            "topics",
            CompactArray(
                ("topic_name", CompactString("utf-8")),
                ("partitions", CompactArray(("partition_index", Int32), ("tags", TaggedFields))),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class DescribeQuorumRequest(Request[DescribeQuorumRequest_v0]):
    API_KEY = 55

    def build(self, request_struct_class: type[DescribeQuorumRequest_v0]) -> DescribeQuorumRequest_v0:
        return request_struct_class([(METADATA_TOPIC, [(0, {})], {})], {})


@dataclass(frozen=True)
class Quorum:
    """The KRaft metadata quorum as its leader reports it."""

    leader: int
    epoch: int
    voters: tuple[int, ...]


@dataclass(frozen=True)
class PartitionState:
    topic: str
    partition: int
    leader: int
    """-1 while the partition has no leader (offline)."""
    replicas: tuple[int, ...]
    isr: tuple[int, ...]

    @property
    def under_replicated(self) -> bool:
        return len(self.isr) < len(self.replicas)


async def _client(settings: KafkaSettings) -> AIOKafkaClient:
    client = AIOKafkaClient(request_timeout_ms=10_000, **client_options(settings))
    await client.bootstrap()
    return client


async def _send_to_any(client: AIOKafkaClient, request: Any) -> Any:
    """Send to the first live broker that answers (one broker may be the one a fault took)."""
    errors: list[str] = []
    for broker in sorted(client.cluster.brokers(), key=lambda b: b.nodeId):
        try:
            return await client.send(broker.nodeId, request)
        except Exception as e:
            errors.append(f"{broker.nodeId}: {e!r}")
    raise ConnectionError("no broker answered: " + "; ".join(errors))


async def live_brokers(settings: KafkaSettings) -> list[int]:
    """Node ids of the brokers the cluster's metadata lists as alive (unfenced)."""
    client = await _client(settings)
    try:
        return sorted(b.nodeId for b in client.cluster.brokers())
    finally:
        await client.close()


async def quorum(settings: KafkaSettings) -> Quorum:
    """The active controller (the quorum leader), its epoch and the voters (DescribeQuorum)."""
    client = await _client(settings)
    try:
        response = await _send_to_any(client, DescribeQuorumRequest())
    finally:
        await client.close()
    if response.error_code:
        raise for_code(response.error_code)("DescribeQuorum failed")
    _, partitions, _ = response.topics[0]
    _, error_code, leader, epoch, _, voters, _, _ = partitions[0]
    if error_code:
        raise for_code(error_code)("DescribeQuorum failed for the metadata partition")
    return Quorum(leader=leader, epoch=epoch, voters=tuple(sorted(v[0] for v in voters)))


async def transaction_coordinator(settings: KafkaSettings, transactional_id: str, timeout_s: float = 15.0) -> int:
    """The broker that coordinates `transactional_id`'s transactions (FindCoordinator, key type 1).

    Retried while the coordinator is not available: the transaction state topic
    is created on first use, and its partition may be between leaders.
    """
    return await _coordinator(settings, transactional_id, TRANSACTION_COORDINATOR, timeout_s)


async def group_coordinator(settings: KafkaSettings, group_id: str, timeout_s: float = 15.0) -> int:
    """The broker that coordinates consumer group `group_id` (FindCoordinator, key type 0)."""
    return await _coordinator(settings, group_id, GROUP_COORDINATOR, timeout_s)


async def _coordinator(settings: KafkaSettings, key: str, key_type: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    client = await _client(settings)
    try:
        while True:
            response = await _send_to_any(client, FindCoordinatorRequest(key, key_type))
            error = for_code(response.error_code) if response.error_code else None
            if error is None:
                return int(response.coordinator_id)
            if not error.retriable or time.monotonic() > deadline:
                raise error(f"FindCoordinator failed for {key!r}")
            await asyncio.sleep(0.2)
    finally:
        await client.close()


async def partition_states(settings: KafkaSettings, topics: list[str] | None = None) -> list[PartitionState]:
    """Leader, replicas and ISR of every partition of `topics` (default: every non-internal topic)."""
    admin = AIOKafkaAdminClient(request_timeout_ms=10_000, **client_options(settings))
    await admin.start()
    try:
        names = topics if topics is not None else [t for t in await admin.list_topics() if not t.startswith("__")]
        described = await admin.describe_topics(sorted(names)) if names else []
    finally:
        await admin.close()
    states = [
        PartitionState(
            topic=t["topic"],
            partition=p["partition"],
            leader=p["leader"],
            replicas=tuple(p["replicas"]),
            isr=tuple(p["isr"]),
        )
        for t in described
        if t["error_code"] == 0
        for p in t["partitions"]
    ]
    return sorted(states, key=lambda s: (s.topic, s.partition))


async def metadata_leaders(settings: KafkaSettings, topic: str, avoid: int) -> dict[int, int]:
    """{partition: leader} of `topic` as a broker other than `avoid` sees it (the admin client may
    ask any broker, and a frozen one never answers)."""
    client = await _client(settings)
    try:
        node = next(b.nodeId for b in sorted(client.cluster.brokers(), key=lambda b: b.nodeId) if b.nodeId != avoid)
        response = await client.send(node, MetadataRequest([topic]))
        view = ClusterMetadata()
        view.update_metadata(response)
        partitions = view.partitions_for_topic(topic) or set()
        return {p: view.leader_for_partition(TopicPartition(topic, p)) for p in sorted(partitions)}
    finally:
        await client.close()


def leader_counts(states: list[PartitionState]) -> dict[int, int]:
    """Partitions led by each broker."""
    counts: dict[int, int] = {}
    for state in states:
        if state.leader >= 0:
            counts[state.leader] = counts.get(state.leader, 0) + 1
    return counts


def java_string_hash(text: str) -> int:
    """Java's String.hashCode (over UTF-16 code units, 32-bit overflow), which Kafka partitions ids by."""
    h = 0
    data = text.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + int.from_bytes(data[i : i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def java_abs(n: int) -> int:
    """Kafka's `Utils.abs` of a Java int: Math.abs, with Integer.MIN_VALUE mapped to 0.

    Not the producer partitioner's `toPositive` (n & 0x7fffffff): for a
    negative odd hash the two differ modulo 4, so an id chosen with the mask
    lands on another partition, and another coordinator, about 1 time in 4.
    """
    return 0 if n == -(1 << 31) else abs(n)


def transaction_partition(transactional_id: str, partitions: int) -> int:
    """The `__transaction_state` partition that holds `transactional_id`: its leader is the id's
    coordinator (Kafka 3.9 to 4.4 `TransactionStateManager.partitionFor`: Utils.abs(id.hashCode) %
    transaction.state.log.num.partitions)."""
    return java_abs(java_string_hash(transactional_id)) % partitions


async def under_replicated(settings: KafkaSettings) -> list[PartitionState]:
    """Partitions of every topic, internal ones included, that lack a leader or a full ISR."""
    admin = AIOKafkaAdminClient(request_timeout_ms=10_000, **client_options(settings))
    await admin.start()
    try:
        names = list(await admin.list_topics())
    finally:
        await admin.close()
    states = await partition_states(settings, [n for n in names if n != METADATA_TOPIC])
    return [s for s in states if s.leader < 0 or s.under_replicated]
