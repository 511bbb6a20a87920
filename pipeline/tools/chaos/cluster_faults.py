"""Faults of one broker in a three-broker cluster, under load: killed, frozen, restarted in turn,
or the KRaft controller killed.

Every row runs the same deployment: the model's topics replicated 3 times with
min.insync.replicas 2, two transactional consumers (results and offsets in one
Kafka transaction), the sink, and the harness's acks=all producer and
read_committed reader, all given every broker's address. Nobody is restarted
by hand. The promise is the single-broker rows' promise made stricter: every
request answered exactly once, every latency event exactly one ClickHouse row.

Each row reports, beside the ledger's lost and duplicated:
- `recovery_s`: from the injection until every request sent before it was
  answered (the cluster never stops as a whole, so recovery is measured from
  the fault, not from the repair);
- `answer_gap_s`: the longest time no new answer appeared while the fault
  lasted (what a client sees of the failover);
- p99 of what a client waits, for requests sent before, during and after;
- `isr_recovered_s`: from the broker's return until no partition, internal
  topics included, lacked a leader or a full ISR;
- `events_recovery_s`: from the end of the fault until the latency event of
  every request answered by then was a ClickHouse row.

The rows share their load and accounting (`cluster_load.py`) and their
questions to the cluster (`cluster_look.py`); `leader-kill`, which must find
a broker that is both leader and coordinator, has a module of its own
(`leader_kill.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pipeline.core.kafka.cluster import leader_counts, quorum
from pipeline.tools.chaos.cluster_load import Injection, under_load
from pipeline.tools.chaos.cluster_look import (
    busiest,
    group_coordinator_of,
    leaders_moved_off,
    look,
    new_controller,
    replication_settled,
    request_leaders,
    restart,
    without,
)
from pipeline.tools.chaos.deployment import Deployment, Stage
from pipeline.tools.chaos.leader_kill import leader_kill
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.steps import ChaosSizes
from pipeline.tools.devtools.localcluster import LocalCluster

__all__ = [
    "broker_freeze",
    "controller_kill",
    "coordinator_freeze",
    "leader_kill",
    "rolling_restart",
    "share_broker_freeze",
    "share_leader_kill",
    "share_rolling_restart",
]


async def broker_freeze(stage: Stage, sizes: ChaosSizes, *, share: bool = False) -> FaultReport:
    """SIGSTOP the broker that leads the most request partitions for `freeze_s`, then SIGCONT:
    it is fenced meanwhile and must come back as a follower, never as a second leader.

    It may lead again afterwards, once it is back in the ISR, when the controller hands a
    partition back to its preferred replica: on Kafka 3.9 a thawed node that is a controller voter
    calls elections at once (pre-vote, KIP-996, came in 4.0), the active controller steps down, and
    the newly elected one rebalances leadership right away. So `victim_leads_after` is reported,
    and what is checked is that it leads only partitions whose preferred replica it is."""

    async def busiest_leader(d: Deployment) -> int:
        return busiest(await request_leaders(d))

    return await _freeze(stage, sizes, f"leader SIGSTOP {sizes.freeze_s:g} s, SIGCONT", busiest_leader, share=share)


async def coordinator_freeze(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """`broker-freeze` of the consumers' group coordinator: with a freeze longer than their session,
    the group expels members that cannot know it yet, whose transactions must not commit offsets
    (aiokafka cannot let the broker fence them: the consumers fence themselves, consumers/fencing.py)."""

    async def group_coordinator(d: Deployment) -> int:
        return await group_coordinator_of(d)

    return await _freeze(stage, sizes, f"group coordinator SIGSTOP {sizes.freeze_s:g} s, SIGCONT", group_coordinator)


async def _freeze(
    stage: Stage, sizes: ChaosSizes, label: str, choose: Callable[[Deployment], Awaitable[int]], *, share: bool = False
) -> FaultReport:
    async def inject(d: Deployment, cluster: LocalCluster) -> Injection:
        leaders = await request_leaders(d)
        victim = await choose(d)
        group_coordinator = await group_coordinator_of(d)
        led = leader_counts(leaders).get(victim, 0)
        spared = without(cluster, d.settings, victim)
        start = time.time()
        cluster.freeze(victim)
        try:
            moved_s = await leaders_moved_off(d, spared, victim, sizes.freeze_s)
            await asyncio.sleep(max(0.0, sizes.freeze_s - (time.time() - start)))
        finally:
            cluster.thaw(victim)
        back = time.time()
        await replication_settled(d.settings)
        recovered = time.time()
        after = [s for s in await request_leaders(d) if s.leader == victim]
        return Injection(
            start,
            recovered,
            details={
                "victim": victim,
                "victim_is_group_coordinator": victim == group_coordinator,
                "victim_led_request_partitions": led,
                "frozen_s": round(back - start, 1),
                "leaders_moved_s": moved_s,
                "isr_recovered_s": round(recovered - back, 1),
                "victim_leads_after": len(after),
                # leading again is right only when the controller handed a partition back to its
                # preferred replica (auto.leader.rebalance.enable), which needs the victim in the ISR
                "victim_leads_only_as_preferred": all(s.replicas[0] == victim and victim in s.isr for s in after),
                "controller_after": (await look(quorum(d.settings))).leader,
            },
        )

    return await under_load(stage, sizes, label, inject, share=share)


async def rolling_restart(stage: Stage, sizes: ChaosSizes, *, share: bool = False) -> FaultReport:
    """Stop (clean shutdown) and restart every broker in turn, the active controller last, waiting
    for every partition's ISR to be full again before the next one, as an upgrade does."""

    async def inject(d: Deployment, cluster: LocalCluster) -> Injection:
        leader = (await look(quorum(d.settings))).leader
        order = sorted(cluster.nodes, key=lambda n: (n.node_id == leader, n.node_id))
        start = time.time()
        steps: list[str] = []
        for node in order:
            began = time.time()
            await asyncio.to_thread(node.stop)
            await restart(node)
            settled_s = await replication_settled(d.settings)
            steps.append(f"{node.node_id}:{time.time() - began:.1f}s(isr {settled_s:.1f}s)")
        return Injection(start, time.time(), injections=len(order), details={"restarts": " ".join(steps)})

    return await under_load(stage, sizes, "rolling restart of every broker", inject, share=share)


async def share_broker_freeze(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """`broker-freeze` with the consumers in a share group: the request partition's leader (which
    may coordinate the share group too) SIGSTOPped for `freeze_s`, then SIGCONT."""
    return await broker_freeze(stage, sizes, share=True)


async def share_rolling_restart(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """`rolling-restart` with the consumers in a share group: every broker stopped and restarted in
    turn, the active controller last."""
    return await rolling_restart(stage, sizes, share=True)


async def share_leader_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL the broker that leads a share group's request partition; it stays down `outage_s`,
    then restarts and rejoins. No transactions, so no coordinator to choose (`leader-kill` needs one
    for the partition group's row). What its share partition had acquired is re-read by the new
    leader from the share coordinator's state: records in flight come back."""

    async def inject(d: Deployment, cluster: LocalCluster) -> Injection:
        victim = busiest(await request_leaders(d))
        node = cluster.node(victim)
        start = time.time()
        await asyncio.to_thread(node.kill)
        moved_s = await leaders_moved_off(d, without(cluster, d.settings, victim), victim, sizes.outage_s)
        await asyncio.sleep(max(0.0, sizes.outage_s - (time.time() - start)))
        back = time.time()
        await restart(node)
        await replication_settled(d.settings)
        return Injection(
            start,
            time.time(),
            details={"victim": victim, "leaders_moved_s": moved_s, "down_s": round(back - start, 1)},
        )

    return await under_load(stage, sizes, f"request leader SIGKILL, down {sizes.outage_s:g} s", inject, share=True)


async def controller_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL the active KRaft controller (the metadata quorum's leader); it stays down `outage_s`,
    then restarts and rejoins the quorum."""

    async def inject(d: Deployment, cluster: LocalCluster) -> Injection:
        before = await look(quorum(d.settings))
        victim = before.leader
        node = cluster.node(victim)
        spared = without(cluster, d.settings, victim)
        start = time.time()
        await asyncio.to_thread(node.kill)
        elected_s = await new_controller(spared, victim, sizes.outage_s + 10.0)
        await asyncio.sleep(max(0.0, sizes.outage_s - (time.time() - start)))
        back = time.time()
        await restart(node)
        await replication_settled(d.settings)
        after = await look(quorum(d.settings))
        return Injection(
            start,
            time.time(),
            details={
                "victim": victim,
                "controller_epoch": f"{before.epoch}->{after.epoch}",
                "new_controller": after.leader,
                "new_controller_s": elected_s,
                "down_s": round(back - start, 1),
                "isr_recovered_s": round(time.time() - back, 1),
            },
        )

    return await under_load(stage, sizes, f"KRaft controller SIGKILL, down {sizes.outage_s:g} s", inject)
