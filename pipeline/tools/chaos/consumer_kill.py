"""Fault: SIGKILL a consumer while it holds work (with and without Kafka transactions)."""

from __future__ import annotations

import asyncio
import time

from pipeline.tools.chaos.deployment import CHAOS_MODEL, CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.steps import ChaosSizes, settle_answers
from pipeline.tools.harness.group_offsets import committed_offsets, consumer_group


async def consumer_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL one of two consumers of the group while it computes a batch.

    The device is busy most of the time (long per-batch cost at this load), so
    the kill lands mid-batch. Every request must be answered; a duplicate is
    allowed only for a request the killed consumer answered after its last
    offset commit (at-least-once), and the row reports how many there were.
    """
    return await _consumer_kill(stage, sizes, transactional=False)


async def consumer_kill_transactional(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """The same SIGKILL with `kafka.transactional = true`: results and offsets commit together, no duplicates."""
    return await _consumer_kill(stage, sizes, transactional=True)


KILL_DEVICE = CostModelDevice(a_ms=60.0, c_ms=3.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
"""The kill rows' device: a long per-batch cost, so that at the scenarios' rate it is busy most of the time."""
VICTIM = "victim"


async def pair_under_load(
    d: Deployment, sizes: ChaosSizes, victim_env: dict[str, str] | None = None
) -> asyncio.Task[list[str]]:
    """Start the victim and a survivor, warm them up, start the steady load and let a third of it
    run; returns the task that sends the rest."""
    d.consumer(VICTIM, env=victim_env)
    d.consumer("survivor")
    await d.warm_up(consumers=2)
    sending = asyncio.create_task(d.traffic.open_loop(sizes.requests, sizes.rate_rps))
    await asyncio.sleep(sizes.requests / sizes.rate_rps / 3)
    return sending


async def _consumer_kill(stage: Stage, sizes: ChaosSizes, *, transactional: bool) -> FaultReport:
    # Without transactions a forward answered by the victim is a second at-least-once path, through
    # the priority partition's uncommitted offsets, that this row's request-partition bound does not
    # count; the row measures the request partitions' bound, so it runs without forwarding there.
    consumer = None if transactional else {"tail_forwarding": False}
    async with Deployment(stage, KILL_DEVICE, partitions=4, transactional=transactional, consumer=consumer) as d:
        victim_id = VICTIM
        sending = await pair_under_load(d, sizes)
        await _until_holding_work(d, victim_id)
        d.check_alive()
        fault_at = time.time()
        d.consumers[victim_id].kill()
        await asyncio.sleep(0.5)
        committed = await committed_offsets(d.settings, consumer_group(d.settings, CHAOS_MODEL))
        await sending
        await settle_answers(d, sizes)
        d.check_alive()
        placement = d.traffic.placement
        exposed = {
            request_id
            for request_id, answers in d.ledger.results.items()
            if answers[0].consumer_id == victim_id
            and request_id in placement
            and placement[request_id][1] >= committed.get(placement[request_id][0], 0)
        }
        duplicated_ids = set(d.ledger.duplicated_ids())
        failures = []
        stray = duplicated_ids - exposed
        if stray:
            failures.append(f"{len(stray)} duplicates were not answered-but-uncommitted by the killed consumer")
        victim_partitions = {
            placement[request_id][0]
            for request_id, answers in d.ledger.results.items()
            if answers[0].consumer_id == victim_id and request_id in placement
        }
        reprocessed = sum(
            1
            for request_id, sent_at in d.ledger.sent.items()
            if sent_at < fault_at
            and request_id in placement
            and placement[request_id][0] in victim_partitions
            and request_id in d.ledger.results
            and d.ledger.results[request_id][0].consumer_id != victim_id
        )
        if reprocessed == 0:
            failures.append(
                "the kill interrupted no work: nothing of the victim's partitions was left for the survivor"
            )
        exposed_batches: dict[int | None, int] = {}
        for request_id in exposed:
            batch_id = d.ledger.results[request_id][0].batch_id
            exposed_batches[batch_id] = exposed_batches.get(batch_id, 0) + 1
        return d.ledger.report(
            "consumer SIGKILL mid-batch" + (" (transactions)" if transactional else ""),
            1,
            fault_end=fault_at,
            duplicate_bound=0 if transactional else len(exposed),
            failures=failures,
            details={
                "answered_uncommitted_by_victim": len(exposed),
                "victim_uncommitted_batch_sizes": sorted(exposed_batches.values(), reverse=True),
                "reprocessed_by_survivor": reprocessed,
            },
        )


async def _until_holding_work(d: Deployment, consumer_id: str, timeout_s: float = 5.0, age_s: float = 0.010) -> None:
    """Wait for a moment when `consumer_id` holds work: a request on one of its partitions
    sent over `age_s` ago and not answered yet. A kill then interrupts a batch instead of
    landing between two (at this load a consumer is idle a third of the time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        placement = d.traffic.placement
        mine = {
            placement[request_id][0]
            for request_id, answers in d.ledger.results.items()
            if answers[0].consumer_id == consumer_id and request_id in placement
        }
        now = time.time()
        if any(
            now - sent_at > age_s and request_id in placement and placement[request_id][0] in mine
            for request_id, sent_at in d.ledger.sent.items()
            if request_id not in d.ledger.results
        ):
            return
        await asyncio.sleep(0.002)
