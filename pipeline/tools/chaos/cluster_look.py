"""What the cluster rows ask of the cluster while a fault runs: who leads, who coordinates, whether
replication is whole, whether a new leader or controller has taken over.

Every question has a time limit (`LOOK_TIMEOUT_S`): a frozen broker never
answers, and a question put to it must not hang the row.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.cluster import (
    PartitionState,
    group_coordinator,
    leader_counts,
    metadata_leaders,
    partition_states,
    quorum,
    transaction_coordinator,
    under_replicated,
)
from pipeline.tools.chaos.deployment import CHAOS_MODEL, Deployment, Stage
from pipeline.tools.chaos.steps import port_released
from pipeline.tools.devtools.localcluster import LocalCluster
from pipeline.tools.devtools.localkafka import LocalKafka
from pipeline.tools.harness.errors import HarnessError
from pipeline.tools.harness.group_offsets import consumer_group

TRANSACTION_STATE = "__transaction_state"
SETTLE_TIMEOUT_S = 120.0
LOOK_TIMEOUT_S = 12.0
"""One look at the cluster (metadata, DescribeQuorum) gives up after this; a frozen broker never answers."""


def cluster_of(stage: Stage) -> LocalCluster:
    if stage.cluster is None or stage.cluster.size < 3:
        raise HarnessError("the cluster rows need a cluster of 3 or more brokers of their own (Stage.cluster)")
    return stage.cluster


def without(cluster: LocalCluster, settings: KafkaSettings, node_id: int) -> KafkaSettings:
    """The harness's own view of the cluster, bootstrapped from the brokers the fault spares."""
    others = ",".join(n.bootstrap for n in cluster.nodes if n.node_id != node_id)
    return KafkaSettings(bootstrap_servers=others, topic_prefix=settings.topic_prefix)


T = TypeVar("T")


async def look(call: Awaitable[T]) -> T:
    return await asyncio.wait_for(call, LOOK_TIMEOUT_S)


async def replication_settled(settings: KafkaSettings, timeout_s: float = SETTLE_TIMEOUT_S) -> float:
    """Wait until every partition (internal topics included) has a leader and its full ISR; seconds it took."""
    started = time.monotonic()
    last: object = None
    while time.monotonic() - started < timeout_s:
        try:
            lacking = await look(under_replicated(settings))
            if not lacking:
                return time.monotonic() - started
            last = lacking[:3]
        except Exception as e:
            last = e
        await asyncio.sleep(0.5)
    raise HarnessError(f"replication did not recover within {timeout_s:.0f} s (last: {last!r})")


async def request_leaders(d: Deployment) -> list[PartitionState]:
    return await look(partition_states(d.settings, [d.topics.requests(CHAOS_MODEL)]))


def busiest(states: list[PartitionState]) -> int:
    """The broker that leads the most request partitions (the lowest id among equals)."""
    counts = leader_counts(states)
    if not counts:
        raise HarnessError("no request partition has a leader")
    return min(counts, key=lambda node: (-counts[node], node))


def leads_the_most(states: list[PartitionState], node_id: int) -> bool:
    counts = leader_counts(states)
    return counts.get(node_id, 0) == max(counts.values(), default=-1) > 0


async def transaction_state(d: Deployment, timeout_s: float = 30.0) -> list[PartitionState]:
    """The transaction state topic's partitions once each has a leader (FindCoordinator creates it)."""
    group = consumer_group(d.settings, CHAOS_MODEL)
    await look(transaction_coordinator(d.settings, f"{group}.probe"))
    deadline = time.monotonic() + timeout_s
    while True:
        states = await look(partition_states(d.settings, [TRANSACTION_STATE]))
        if states and all(s.leader >= 0 for s in states):
            return states
        if time.monotonic() > deadline:
            raise HarnessError(f"{TRANSACTION_STATE} has partitions without a leader: {states}")
        await asyncio.sleep(0.3)


async def group_coordinator_of(d: Deployment) -> int:
    """The broker that coordinates the consumers' group now (FindCoordinator for the group)."""
    return await look(group_coordinator(d.settings, consumer_group(d.settings, CHAOS_MODEL)))


async def coordinator_of(d: Deployment, consumer_id: str) -> int:
    """The broker that coordinates a consumer's transactions now (FindCoordinator for `<group>.<id>`)."""
    return await look(transaction_coordinator(d.settings, f"{consumer_group(d.settings, CHAOS_MODEL)}.{consumer_id}"))


async def leaders_moved_off(d: Deployment, spared: KafkaSettings, victim: int, timeout_s: float) -> float | None:
    """Seconds until no request partition names the frozen broker as leader (None: not within the freeze)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            leaders = await asyncio.wait_for(metadata_leaders(spared, d.topics.requests(CHAOS_MODEL), victim), 3.0)
            if leaders and all(leader not in (victim, -1, None) for leader in leaders.values()):
                return round(time.monotonic() - started, 1)
        except Exception:
            pass
        await asyncio.sleep(0.3)
    return None


async def new_controller(spared: KafkaSettings, victim: int, timeout_s: float) -> float | None:
    """Seconds until the quorum has a leader other than the killed one (None: not within `timeout_s`)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            leader = (await look(quorum(spared))).leader
            if leader not in (victim, -1):
                return round(time.monotonic() - started, 2)
        except Exception:
            pass
        await asyncio.sleep(0.1)
    return None


async def restart(node: LocalKafka) -> None:
    await port_released(node.port)
    await asyncio.to_thread(node.start, 120.0)
