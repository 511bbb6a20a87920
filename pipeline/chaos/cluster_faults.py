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

Events are followed as rows (read from the sink's read-only server), not as
the sink's committed offsets: the consumers write them in transactions, so the
events topics hold transaction markers, and faust's commit advances over such
gaps by a record or two per partition and commit (faust-streaming/faust#606):
the rows are there long before the offsets say so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.chaos.deployment import CHAOS_MODEL, Deployment, Device, Stage
from pipeline.chaos.steps import port_released, settle_answers, ChaosSizes
from pipeline.harness.errors import HarnessError
from pipeline.harness.offsets import consumer_group
from pipeline.chaos.ledger import EventTally, FaultReport
from pipeline.core.config import ClickHouseSettings, KafkaSettings
from pipeline.devtools.localcluster import LocalCluster
from pipeline.devtools.localkafka import LocalKafka
from pipeline.core.store.live import connect_live, find
from pipeline.core.kafka.cluster import (
    PartitionState,
    leader_counts,
    metadata_leaders,
    partition_states,
    quorum,
    transaction_coordinator,
    transaction_partition,
    under_replicated,
)

TRANSACTION_STATE = "__transaction_state"
DEVICE = Device(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
BEFORE_S = 6.0
AFTER_S = 4.0
SETTLE_TIMEOUT_S = 120.0
LOOK_TIMEOUT_S = 12.0
"""One look at the cluster (metadata, DescribeQuorum) gives up after this; a frozen broker never answers."""
IN_FLIGHT_S = 2.0
"""Requests sent this long before the injection count as sent during the fault (they were in flight when it hit)."""


@dataclass
class Injection:
    """What a fault did: when it began and ended (wall clock) and its own figures."""

    start: float
    end: float
    injections: int = 1
    details: dict[str, Any] = field(default_factory=dict)


Inject = Callable[[Deployment, LocalCluster], Awaitable[Injection]]


def _cluster(stage: Stage) -> LocalCluster:
    if stage.cluster is None or stage.cluster.size < 3:
        raise HarnessError("the cluster rows need a cluster of 3 or more brokers of their own (Stage.cluster)")
    return stage.cluster


def _without(cluster: LocalCluster, settings: KafkaSettings, node_id: int) -> KafkaSettings:
    """The harness's own view of the cluster, bootstrapped from the brokers the fault spares."""
    others = ",".join(n.bootstrap for n in cluster.nodes if n.node_id != node_id)
    return KafkaSettings(bootstrap_servers=others, topic_prefix=settings.topic_prefix)


async def _look(call: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(call, LOOK_TIMEOUT_S)


async def _replication_settled(settings: KafkaSettings, timeout_s: float = SETTLE_TIMEOUT_S) -> float:
    """Wait until every partition (internal topics included) has a leader and its full ISR; seconds it took."""
    started = time.monotonic()
    last: object = None
    while time.monotonic() - started < timeout_s:
        try:
            lacking = await _look(under_replicated(settings))
            if not lacking:
                return time.monotonic() - started
            last = lacking[:3]
        except Exception as e:  # noqa: BLE001 - a broker is still coming back: look again
            last = e
        await asyncio.sleep(0.5)
    raise HarnessError(f"replication did not recover within {timeout_s:.0f} s (last: {last!r})")


async def _request_leaders(d: Deployment, settings: KafkaSettings) -> list[PartitionState]:
    return await _look(partition_states(settings, [d.topics.requests(CHAOS_MODEL)]))


def _busiest(states: list[PartitionState]) -> int:
    """The broker that leads the most request partitions (the lowest id among equals)."""
    counts = leader_counts(states)
    if not counts:
        raise HarnessError("no request partition has a leader")
    return min(counts, key=lambda node: (-counts[node], node))


async def _transaction_state(d: Deployment, timeout_s: float = 30.0) -> list[PartitionState]:
    """The transaction state topic's partitions once each has a leader (FindCoordinator creates it)."""
    group = consumer_group(d.settings, CHAOS_MODEL)
    await _look(transaction_coordinator(d.settings, f"{group}.probe"))
    deadline = time.monotonic() + timeout_s
    while True:
        states = await _look(partition_states(d.settings, [TRANSACTION_STATE]))
        if states and all(s.leader >= 0 for s in states):
            return states
        if time.monotonic() > deadline:
            raise HarnessError(f"{TRANSACTION_STATE} has partitions without a leader: {states}")
        await asyncio.sleep(0.3)


def _coordinated_by(d: Deployment, states: list[PartitionState], node_id: int) -> str:
    """A consumer id whose transactional id `<group>.<id>` has its coordinator on `node_id`.

    The coordinator is the leader of the transaction state partition the id
    hashes to, so the id is chosen to fit the broker.
    """
    group = consumer_group(d.settings, CHAOS_MODEL)
    led = {s.partition for s in states if s.leader == node_id}
    for k in range(10_000):
        candidate = f"c1-{k}"
        if transaction_partition(f"{group}.{candidate}", len(states)) in led:
            return candidate
    raise HarnessError(f"no consumer id hashes to a {TRANSACTION_STATE} partition led by broker {node_id}")


def _leads_the_most(states: list[PartitionState], node_id: int) -> bool:
    counts = leader_counts(states)
    return counts.get(node_id, 0) == max(counts.values(), default=-1) > 0


async def _under_load(
    stage: Stage,
    sizes: ChaosSizes,
    title: str,
    inject: Inject,
    *,
    victim_consumer: Callable[[Deployment], Awaitable[str]] | None = None,
) -> FaultReport:
    """Deploy two transactional consumers and the sink on the cluster, send steady traffic, inject
    the fault, keep sending a while after it, and account for every request and event."""
    cluster = _cluster(stage)
    async with Deployment(stage, DEVICE, partitions=4, transactional=True) as d:
        await _replication_settled(d.settings)
        first = await victim_consumer(d) if victim_consumer is not None else "c1"
        d.consumer(first)
        d.consumer("c2")
        d.sink()
        await d.warm_up(consumers=2)
        await d.sink_ready(sizes.answer_timeout_s)
        stop = asyncio.Event()
        sending = asyncio.create_task(d.traffic.open_loop(10**9, sizes.rate_rps, until=stop.is_set))
        await asyncio.sleep(BEFORE_S)
        try:
            injection = await inject(d, cluster)
        except BaseException:
            stop.set()
            await asyncio.gather(sending, return_exceptions=True)
            raise
        answered_by_end = _answered_event_ids(d)
        stored_at = await _rows_stored(d, answered_by_end, sizes.answer_timeout_s)
        await asyncio.sleep(max(0.0, injection.end + AFTER_S - time.time()))
        stop.set()
        await sending
        await settle_answers(d, sizes)
        d.check_alive()
        await _rows_stored(d, _answered_event_ids(d), sizes.answer_timeout_s)
        for sink in d.sinks:
            sink.terminate()
        lost, double, counted = d.event_accounting(await d.clickhouse_rows())
        events = EventTally(stored_at, lost, double, counted)
        gap = _answer_gap(d, injection.start, injection.end)
        return d.ledger.report(
            title,
            injection.injections,
            fault_end=injection.start,
            duplicate_bound=0,
            events=events,
            details={
                **injection.details,
                "fault_window_s": round(injection.end - injection.start, 1),
                "answer_gap_s": gap,
                **d.ledger.p99_by_phase(injection.start - IN_FLIGHT_S, injection.end),
                "events_recovery_s": events.recovery_after(injection.end),
            },
        )


def _answered_event_ids(d: Deployment) -> set[str]:
    """Ids whose latency event must become a row: every answer but a rejection (warm-ups included)."""
    return {i for i, answers in d.ledger.results.items() if answers[0].outcome != "rejected"}


async def _rows_stored(d: Deployment, ids: set[str], timeout_s: float) -> float | None:
    """Wall-clock time once every id in `ids` has a latency row, read from the running sink's
    read-only server (never by opening the store the sink holds); None on timeout."""
    settings = ClickHouseSettings(data_dir=str(d.clickhouse_dir))

    def stored() -> set[str]:
        endpoint = find(settings)
        if endpoint is None:
            return set()
        client = connect_live(endpoint, "batchtide")
        try:
            return {row[0] for row in client.query("SELECT DISTINCT request_id FROM request_latency").result_rows}
        finally:
            client.close()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        d.check_alive()
        try:
            if ids <= await asyncio.to_thread(stored):
                return time.time()
        except Exception:  # noqa: BLE001 - the sink's server is busy or restarting: ask again
            pass
        await asyncio.sleep(0.5)
    return None


def _answer_gap(d: Deployment, start: float, end: float) -> float:
    """Longest stretch in [start, end] (with the last answer before start) without a new answer."""
    seen = sorted(
        answers[0].at for request_id, answers in d.ledger.results.items() if request_id in d.ledger.sent
    )
    window = [at for at in seen if start <= at <= end]
    before = [at for at in seen if at < start]
    marks = ([before[-1]] if before else [start]) + window
    if not window:
        return round(end - marks[0], 2)
    return round(max(b - a for a, b in zip(marks, marks[1:])), 2)


async def _restart(node: LocalKafka) -> None:
    await port_released(node.port)
    await asyncio.to_thread(node.start, 120.0)


VICTIM_SETTLE_S = 20.0
"""How long `leader-kill` waits for the chosen broker to lead and coordinate again before it gives up."""


async def leader_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL the broker that leads the most request partitions and coordinates a consumer's
    transactions; it stays down `outage_s`, then restarts and rejoins."""
    chosen: dict[str, Any] = {}

    async def choose(d: Deployment) -> str:
        await _transaction_state(d)
        await _replication_settled(d.settings)  # the new transaction state topic's leaders settle first
        requests = await _request_leaders(d, d.settings)
        coordinators = {s.leader for s in await _transaction_state(d)}
        fitting = [node for node in coordinators if _leads_the_most(requests, node)]
        if not fitting:
            raise HarnessError(
                f"no broker both leads the most request partitions ({leader_counts(requests)}) "
                f"and leads a {TRANSACTION_STATE} partition (leaders {sorted(coordinators)})"
            )
        chosen["victim"] = min(fitting)
        chosen["consumer"] = _coordinated_by(d, await _transaction_state(d), min(fitting))
        return str(chosen["consumer"])

    async def inject(d: Deployment, cluster: LocalCluster) -> Injection:
        victim = int(chosen["victim"])
        group = consumer_group(d.settings, CHAOS_MODEL)
        deadline = time.monotonic() + VICTIM_SETTLE_S
        while True:  # leadership can still be moving from the topics' creation: give it time to settle
            states = await _request_leaders(d, d.settings)
            coordinator = await _look(transaction_coordinator(d.settings, f"{group}.{chosen['consumer']}"))
            if (_leads_the_most(states, victim) and coordinator == victim) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(1.0)
        led = leader_counts(states).get(victim, 0)
        if not _leads_the_most(states, victim) or coordinator != victim:
            raise HarnessError(
                f"broker {victim} no longer both leads the most request partitions and coordinates "
                f"{chosen['consumer']} (coordinator {coordinator}, leaders {leader_counts(states)})"
            )
        node = cluster.node(victim)
        start = time.time()
        await asyncio.to_thread(node.kill)
        await asyncio.sleep(sizes.outage_s)
        back = time.time()
        await _restart(node)
        await _replication_settled(d.settings)
        return Injection(
            start,
            time.time(),
            details={
                "victim": victim,
                "victim_led_request_partitions": f"{led}/{len(states)}",
                "victim_coordinated": f"{group}.{chosen['consumer']}",
                "down_s": round(back - start, 1),
                "isr_recovered_s": round(time.time() - back, 1),
            },
        )

    return await _under_load(stage, sizes, f"leader + txn coordinator SIGKILL, down {sizes.outage_s:g} s", inject, victim_consumer=choose)


async def broker_freeze(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGSTOP the broker that leads the most request partitions for `freeze_s`, then SIGCONT:
    it is fenced meanwhile and must come back as a follower, never as a second leader."""

    async def inject(d: Deployment, cluster: LocalCluster) -> Injection:
        victim = _busiest(await _request_leaders(d, d.settings))
        led = leader_counts(await _request_leaders(d, d.settings)).get(victim, 0)
        spared = _without(cluster, d.settings, victim)
        start = time.time()
        cluster.freeze(victim)
        try:
            moved_s = await _leaders_moved_off(d, spared, victim, sizes.freeze_s)
            await asyncio.sleep(max(0.0, sizes.freeze_s - (time.time() - start)))
        finally:
            cluster.thaw(victim)
        back = time.time()
        await _replication_settled(d.settings)
        recovered = time.time()
        return Injection(
            start,
            recovered,
            details={
                "victim": victim,
                "victim_led_request_partitions": led,
                "frozen_s": round(back - start, 1),
                "leaders_moved_s": moved_s,
                "isr_recovered_s": round(recovered - back, 1),
                "victim_leads_after": leader_counts(await _request_leaders(d, d.settings)).get(victim, 0),
            },
        )

    return await _under_load(stage, sizes, f"leader SIGSTOP {sizes.freeze_s:g} s, SIGCONT", inject)


async def _leaders_moved_off(d: Deployment, spared: KafkaSettings, victim: int, timeout_s: float) -> float | None:
    """Seconds until no request partition names the frozen broker as leader (None: not within the freeze)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            leaders = await asyncio.wait_for(metadata_leaders(spared, d.topics.requests(CHAOS_MODEL), victim), 3.0)
            if leaders and all(leader not in (victim, -1, None) for leader in leaders.values()):
                return round(time.monotonic() - started, 1)
        except Exception:  # noqa: BLE001 - metadata in flux: look again
            pass
        await asyncio.sleep(0.3)
    return None


async def rolling_restart(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """Stop (clean shutdown) and restart every broker in turn, the active controller last, waiting
    for every partition's ISR to be full again before the next one, as an upgrade does."""

    async def inject(d: Deployment, cluster: LocalCluster) -> Injection:
        leader = (await _look(quorum(d.settings))).leader
        order = sorted(cluster.nodes, key=lambda n: (n.node_id == leader, n.node_id))
        start = time.time()
        steps: list[str] = []
        for node in order:
            began = time.time()
            await asyncio.to_thread(node.stop)
            await _restart(node)
            settled_s = await _replication_settled(d.settings)
            steps.append(f"{node.node_id}:{time.time() - began:.1f}s(isr {settled_s:.1f}s)")
        return Injection(start, time.time(), injections=len(order), details={"restarts": " ".join(steps)})

    return await _under_load(stage, sizes, "rolling restart of every broker", inject)


async def controller_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL the active KRaft controller (the metadata quorum's leader); it stays down `outage_s`,
    then restarts and rejoins the quorum."""

    async def inject(d: Deployment, cluster: LocalCluster) -> Injection:
        before = await _look(quorum(d.settings))
        victim = before.leader
        node = cluster.node(victim)
        spared = _without(cluster, d.settings, victim)
        start = time.time()
        await asyncio.to_thread(node.kill)
        elected_s = await _new_controller(spared, victim, sizes.outage_s + 10.0)
        await asyncio.sleep(max(0.0, sizes.outage_s - (time.time() - start)))
        back = time.time()
        await _restart(node)
        await _replication_settled(d.settings)
        after = await _look(quorum(d.settings))
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

    return await _under_load(stage, sizes, f"KRaft controller SIGKILL, down {sizes.outage_s:g} s", inject)


async def _new_controller(spared: KafkaSettings, victim: int, timeout_s: float) -> float | None:
    """Seconds until the quorum has a leader other than the killed one (None: not within `timeout_s`)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            leader = (await _look(quorum(spared))).leader
            if leader not in (victim, -1):
                return round(time.monotonic() - started, 2)
        except Exception:  # noqa: BLE001 - no leader yet: ask again
            pass
        await asyncio.sleep(0.1)
    return None
