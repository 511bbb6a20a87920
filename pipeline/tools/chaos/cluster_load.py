"""The load every cluster row runs under, and its accounting: two transactional consumers and the
sink on the cluster, steady open-loop traffic before, through and after the fault, then the ledger.

Events are followed as rows (read from the sink's read-only server), not as
the sink's committed offsets: the consumers write them in transactions, so the
events topics hold transaction markers, and faust's commit advances over such
gaps by a record or two per partition and commit (faust-streaming/faust#606):
the rows are there long before the offsets say so.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from consumers.fencing import LEFT_FOR_OWNERS, SELF_FENCED
from consumers.fetch_watchdog import REFRESHED, UNBLOCKED
from consumers.publish import TXN_OFFSETS_REFUSED
from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.live import connect_live, find
from pipeline.tools.chaos.cluster_look import cluster_of, replication_settled
from pipeline.tools.chaos.deployment import CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import EventTally, FaultReport
from pipeline.tools.chaos.steps import ChaosSizes, settle_answers
from pipeline.tools.devtools.localcluster import LocalCluster

DEVICE = CostModelDevice(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
BEFORE_S = 6.0
AFTER_S = 4.0
IN_FLIGHT_S = 2.0
"""Requests sent this long before the injection count as sent during the fault (they were in flight when it hit)."""
CONSUMER_IDS = ("c1", "c2")


@dataclass
class Injection:
    """What a fault did: when it began and ended (wall clock) and its own figures."""

    start: float
    end: float
    injections: int = 1
    details: dict[str, Any] = field(default_factory=dict)


Inject = Callable[[Deployment, LocalCluster], Awaitable[Injection]]
ChooseConsumers = Callable[[Deployment], Awaitable[tuple[str, str]]]


async def under_load(
    stage: Stage,
    sizes: ChaosSizes,
    title: str,
    inject: Inject,
    *,
    consumer_ids: ChooseConsumers | None = None,
    share: bool = False,
) -> FaultReport:
    """Deploy two transactional consumers (ids from `consumer_ids`, default c1 and c2) and the sink
    on the cluster, send steady traffic, inject the fault, keep sending a while after it, and
    account for every request and event.

    `share`: the two consumers in a share group on one request partition instead (at-least-once:
    duplicates on the results topic are reported, and none may pass a reader keeping the first
    answer per id; a request answered twice has two latency events, reported, not a failure)."""
    cluster = cluster_of(stage)
    deployment = (
        Deployment(stage, DEVICE, partitions=1, consumer={"group_type": "share"})
        if share
        else Deployment(stage, DEVICE, partitions=4, transactional=True)
    )
    async with deployment as d:
        await replication_settled(d.settings)
        for consumer_id in await consumer_ids(d) if consumer_ids is not None else CONSUMER_IDS:
            d.consumer(consumer_id)
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
        answered_by_end = answered_event_ids(d)
        stored_at = await rows_stored(d, answered_by_end, sizes.answer_timeout_s)
        await asyncio.sleep(max(0.0, injection.end + AFTER_S - time.time()))
        stop.set()
        await sending
        await settle_answers(d, sizes)
        d.check_alive()
        await rows_stored(d, answered_event_ids(d), sizes.answer_timeout_s)
        for sink in d.sinks:
            sink.terminate()
        lost, double, counted = d.event_accounting(await d.clickhouse_rows())
        events = EventTally(stored_at, lost, 0 if share else double, counted)
        past = d.ledger.duplicated_past_dedup()
        return d.ledger.report(
            title + (" (share group)" if share else ""),
            injection.injections,
            fault_end=injection.start,
            duplicate_bound=None if share else 0,
            failures=[f"{past} duplicates passed a reader keeping the first answer per id"] if past else [],
            events=events,
            details={
                **injection.details,
                "fault_window_s": round(injection.end - injection.start, 1),
                "answer_gap_s": answer_gap(d, injection.start, injection.end),
                **d.ledger.p99_by_phase(injection.start - IN_FLIGHT_S, injection.end),
                "events_recovery_s": events.recovery_after(injection.end),
                **fetch_watchdog_counts(d),
                **({"duplicated_past_dedup": past} if share else {}),
            },
        )


def answered_event_ids(d: Deployment) -> set[str]:
    """Ids whose latency event must become a row: every answer but a rejection (warm-ups included)."""
    return {i for i, answers in d.ledger.results.items() if answers[0].outcome != "rejected"}


async def rows_stored(d: Deployment, ids: set[str], timeout_s: float) -> float | None:
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
        except Exception:
            pass
        await asyncio.sleep(0.5)
    return None


def answer_gap(d: Deployment, start: float, end: float) -> float:
    """Longest stretch in [start, end] (with the last answer before start) without a new answer."""
    seen = sorted(answers[0].at for request_id, answers in d.ledger.results.items() if request_id in d.ledger.sent)
    window = [at for at in seen if start <= at <= end]
    before = [at for at in seen if at < start]
    marks = ([before[-1]] if before else [start]) + window
    if not window:
        return round(end - marks[0], 2)
    return round(max(b - a for a, b in itertools.pairwise(marks)), 2)


def fetch_watchdog_counts(d: Deployment) -> dict[str, int]:
    """How often the consumers' fetch watchdogs found a stalled partition and had to reconnect
    (`consumers/fetch_watchdog.py`), how often a consumer self-fenced a transaction
    (`consumers/fencing.py`) and how often the group coordinator refused one's offsets
    (`consumers/publish.py`), counted in their logs."""
    logs = [proc.log_text() for proc in d.consumers.values()]
    return {
        "fetch_stalls_seen": sum(text.count(REFRESHED) for text in logs),
        "fetch_stalls_unblocked": sum(text.count(UNBLOCKED) for text in logs),
        "transactions_self_fenced": sum(text.count(SELF_FENCED) for text in logs),
        "self_fenced_records_left": sum(text.count(LEFT_FOR_OWNERS) for text in logs),
        "txn_offsets_refused": sum(text.count(TXN_OFFSETS_REFUSED) for text in logs),
    }
