"""`leader-kill`: SIGKILL the broker that leads the most request partitions and coordinates a
consumer's transactions, under load; it stays down `outage_s`, then restarts and rejoins.

Both conditions must hold at the kill, and leadership moves (the transaction
state topic is created on first use, and its partitions and the request
partitions can change leaders while they settle), so the victim is chosen
right before the kill from what the cluster says then: the request
partitions' leaders (DescribeTopics) and each consumer's coordinator
(FindCoordinator). To make a fitting victim likely, the two consumers' ids
are chosen beforehand so that their transactional ids (`<group>.<id>`) hash
to `__transaction_state` partitions led by two different brokers, the first
one leading the most request partitions. If no broker fits at the kill, the
consumers are reseated (two new ids chosen against the leadership of the
moment, started, then the old ones stopped cleanly) up to `MAX_RESEATS` times,
reported as `consumers_reseated`; a cluster that still gives no fitting victim
is a setup error, never a silent pass.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pipeline.core.kafka.cluster import PartitionState, leader_counts, transaction_partition
from pipeline.tools.chaos.cluster_load import Injection, under_load
from pipeline.tools.chaos.cluster_look import (
    TRANSACTION_STATE,
    coordinator_of,
    leads_the_most,
    replication_settled,
    request_leaders,
    restart,
    transaction_state,
)
from pipeline.tools.chaos.deployment import CHAOS_MODEL, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.steps import ChaosSizes
from pipeline.tools.devtools.localcluster import LocalCluster
from pipeline.tools.harness.errors import HarnessError
from pipeline.tools.harness.group_offsets import consumer_group

MAX_RESEATS = 3
GROUP_TIMEOUT_S = 90.0
"""How long a reseat waits for the new consumers to join and the old ones to leave."""


@dataclass
class Seating:
    """The consumers serving now, and how many times they were replaced to find a victim."""

    ids: tuple[str, str] = ("", "")
    generation: int = 0
    reseated: int = 0


@dataclass(frozen=True)
class Victim:
    node: int
    consumer_id: str
    requests: list[PartitionState]


def _id_coordinated_by(d: Deployment, states: list[PartitionState], node_id: int, prefix: str) -> str:
    """A consumer id whose transactional id `<group>.<id>` hashes to a transaction state partition
    `node_id` leads (that leader is the id's coordinator)."""
    group = consumer_group(d.settings, CHAOS_MODEL)
    led = {s.partition for s in states if s.leader == node_id}
    for k in range(10_000):
        candidate = f"{prefix}{k}"
        if transaction_partition(f"{group}.{candidate}", len(states)) in led:
            return candidate
    raise HarnessError(f"no consumer id hashes to a {TRANSACTION_STATE} partition led by broker {node_id}")


async def choose_ids(d: Deployment, generation: int) -> tuple[str, str]:
    """Two consumer ids whose coordinators are on different brokers, the first on a broker that
    leads the most request partitions now (when one of those leads a transaction state partition)."""
    await replication_settled(d.settings)
    states = await transaction_state(d)
    requests = await request_leaders(d)
    counts = leader_counts(requests)
    coordinating = sorted({s.leader for s in states}, key=lambda node: (-counts.get(node, 0), node))
    if len(coordinating) < 2:
        raise HarnessError(
            f"setup error: every {TRANSACTION_STATE} partition is led by broker {coordinating}, so the two "
            "consumers cannot have their transaction coordinators on different brokers"
        )
    first, second = coordinating[:2]
    return (
        _id_coordinated_by(d, states, first, f"c1-g{generation}-"),
        _id_coordinated_by(d, states, second, f"c2-g{generation}-"),
    )


async def find_victim(d: Deployment, ids: tuple[str, str]) -> tuple[Victim | None, str]:
    """The broker that leads the most request partitions and coordinates one of `ids`, asked now;
    (None, what the cluster said) when none does."""
    requests = await request_leaders(d)
    coordinators = {consumer_id: await coordinator_of(d, consumer_id) for consumer_id in ids}
    fitting = sorted(
        (node, consumer_id) for consumer_id, node in coordinators.items() if leads_the_most(requests, node)
    )
    if fitting:
        return Victim(fitting[0][0], fitting[0][1], requests), ""
    return None, f"request partition leaders {leader_counts(requests)}, coordinators {coordinators}"


async def reseat(d: Deployment, seating: Seating) -> None:
    """Replace both consumers by two with new ids chosen against the leadership of now: the new
    ones join first, then the old ones leave cleanly (committing what they answered)."""
    old = seating.ids
    seating.generation += 1
    seating.ids = await choose_ids(d, seating.generation)
    for consumer_id in seating.ids:
        d.consumer(consumer_id)
    await d.wait_group_size(4, GROUP_TIMEOUT_S)
    await asyncio.gather(*(asyncio.to_thread(d.consumers[consumer_id].terminate, 30.0) for consumer_id in old))
    await d.wait_group_size(2, GROUP_TIMEOUT_S)
    seating.reseated += 1


async def leader_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL the broker that leads the most request partitions and coordinates a consumer's
    transactions (chosen at the kill); it stays down `outage_s`, then restarts and rejoins."""
    seating = Seating()

    async def seat(d: Deployment) -> tuple[str, str]:
        seating.ids = await choose_ids(d, seating.generation)
        return seating.ids

    async def inject(d: Deployment, cluster: LocalCluster) -> Injection:
        victim, said = await find_victim(d, seating.ids)
        while victim is None:
            if seating.reseated >= MAX_RESEATS:
                raise HarnessError(
                    f"setup error: after {seating.reseated} reseats of the consumers no broker both leads the most "
                    f"request partitions and coordinates a consumer's transactions ({said})"
                )
            await reseat(d, seating)
            victim, said = await find_victim(d, seating.ids)
        led = leader_counts(victim.requests).get(victim.node, 0)
        node = cluster.node(victim.node)
        start = time.time()
        await asyncio.to_thread(node.kill)
        await asyncio.sleep(sizes.outage_s)
        back = time.time()
        await restart(node)
        await replication_settled(d.settings)
        return Injection(
            start,
            time.time(),
            details={
                "victim": victim.node,
                "victim_led_request_partitions": f"{led}/{len(victim.requests)}",
                "victim_coordinated": f"{consumer_group(d.settings, CHAOS_MODEL)}.{victim.consumer_id}",
                "consumers_reseated": seating.reseated,
                "down_s": round(back - start, 1),
                "isr_recovered_s": round(time.time() - back, 1),
            },
        )

    title = f"leader + txn coordinator SIGKILL, down {sizes.outage_s:g} s"
    return await under_load(stage, sizes, title, inject, consumer_ids=seat)
