"""Fault: SIGKILL a share-group consumer mid-batch; its records come back when their lock expires."""

from __future__ import annotations

import asyncio
import time

from pipeline.tools.chaos.deployment import CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.steps import ChaosSizes, settle_answers

LOCK_S = 30.0
"""The broker's default record lock (`group.share.record.lock.duration.ms`): what a killed member's
records wait before the group delivers them again."""


async def share_consumer_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL one of two consumers of a share group (one request partition, shared) while it
    computes a batch. Nothing releases its records, so they come back when their lock expires and
    the survivor answers them. Every request must be answered; repeats on the results topic are
    reported, and none may pass a reader keeping the first answer per id."""
    device = CostModelDevice(a_ms=60.0, c_ms=3.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    async with Deployment(stage, device, partitions=1, consumer={"group_type": "share"}) as d:
        victim_id = "victim"
        d.consumer(victim_id)
        d.consumer("survivor")
        await d.warm_up(consumers=2)
        sending = asyncio.create_task(d.traffic.open_loop(sizes.requests, sizes.rate_rps))
        await asyncio.sleep(sizes.requests / sizes.rate_rps / 3)
        await _until_answering(d, victim_id)
        d.check_alive()
        fault_at = time.time()
        d.consumers[victim_id].kill()
        await sending
        await settle_answers(d, sizes)
        d.check_alive()
        held = [
            request_id
            for request_id, sent_at in d.ledger.sent.items()
            if sent_at < fault_at
            and request_id in d.ledger.results
            and d.ledger.results[request_id][0].consumer_id != victim_id
            and d.ledger.results[request_id][0].at > fault_at + 0.8 * LOCK_S
        ]
        came_back_s = [d.ledger.results[request_id][0].at - fault_at for request_id in held]
        past = d.ledger.duplicated_past_dedup()
        failures = []
        if not held:
            failures.append("the kill interrupted no work: no record came back after the victim's lock")
        if past:
            failures.append(f"{past} duplicates passed a reader keeping the first answer per id")
        return d.ledger.report(
            "consumer SIGKILL mid-batch (share group)",
            1,
            fault_end=fault_at,
            duplicate_bound=None,
            failures=failures,
            details={
                "held_by_victim": len(held),
                "came_back_after_s": round(min(came_back_s), 1) if came_back_s else None,
                "duplicated_past_dedup": past,
            },
        )


async def _until_answering(d: Deployment, consumer_id: str, timeout_s: float = 10.0) -> None:
    """Wait until `consumer_id` answered a request in the last 100 ms: it is serving, and at this load
    its device is busy most of the time, so a kill then lands mid-batch."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = time.time()
        if any(
            answers[0].consumer_id == consumer_id and now - answers[0].at < 0.1 for answers in d.ledger.results.values()
        ):
            return
        await asyncio.sleep(0.01)
