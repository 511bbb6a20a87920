"""Fault: SIGKILL a share-group consumer while it holds acquired records; they come back to the group."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from consumers.runners.cost_model import SLOWDOWN_FILE_ENV
from pipeline.tools.chaos.consumer_kill import KILL_DEVICE, VICTIM, pair_under_load
from pipeline.tools.chaos.deployment import Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.steps import ChaosSizes, settle_answers

HOLD_FACTOR = 30.0
"""From the moment the kill is chosen, the victim's batches cost this many times more (about 2 s
each): the batch it runs when killed holds its records for certain, not for a third of the time."""
SILENT_S = 1.0
"""The victim is taken to be inside such a batch once it has answered nothing for this long (its
runner re-reads the slowdown within 0.5 s and its normal batches take about 0.1 s)."""
STUCK_S = 0.8
"""A request sent this long before the kill and not answered by then was held by the victim: the
survivor alone serves the scenarios' rate with room to spare, so nothing else waits that long."""


async def share_consumer_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL one of two consumers of a share group (one request partition, shared) while it
    holds acquired records in a batch. Nothing acknowledges them, so the group delivers them again
    (when the broker sees the member's connection close, or at the latest when their lock expires)
    and the survivor answers them. Every request must be answered, the kill must have caught records
    held, repeats on the results topic are reported, and none may pass a reader keeping the first
    answer per id."""
    slowdown = stage.workdir / "victim-slowdown"
    async with Deployment(stage, KILL_DEVICE, partitions=1, consumer={"group_type": "share"}) as d:
        sending = await pair_under_load(d, sizes, victim_env={SLOWDOWN_FILE_ENV: str(slowdown)})
        await _until_holding(d, slowdown)
        d.check_alive()
        fault_at = time.time()
        d.consumers[VICTIM].kill()
        await sending
        await settle_answers(d, sizes)
        d.check_alive()
        held = [
            request_id
            for request_id, sent_at in d.ledger.sent.items()
            if sent_at < fault_at - STUCK_S
            and request_id in d.ledger.results
            and d.ledger.results[request_id][0].at > fault_at
        ]
        came_back_s = [d.ledger.results[request_id][0].at - fault_at for request_id in held]
        past = d.ledger.duplicated_past_dedup()
        failures = []
        if not held:
            failures.append("the kill interrupted no work: no request held by the victim was answered after it")
        if any(d.ledger.results[request_id][0].consumer_id == VICTIM for request_id in held):
            failures.append("a request held at the kill was answered by the killed consumer")
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
                "came_back_after_s": round(min(came_back_s), 2) if came_back_s else None,
                "all_back_after_s": round(max(came_back_s), 2) if came_back_s else None,
                "duplicated_past_dedup": past,
            },
        )


async def _until_holding(d: Deployment, slowdown: Path, timeout_s: float = 10.0) -> None:
    """Slow the victim's batches down (HOLD_FACTOR) and wait until it has answered nothing for
    SILENT_S while its survivor kept answering: it is then inside a long batch, holding its records."""
    now_ms = time.time() * 1000.0
    slowdown.write_text(f"{now_ms:.0f} {now_ms + 600_000:.0f} {HOLD_FACTOR:g}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = time.time()
        last = {VICTIM: 0.0}
        for answers in d.ledger.results.values():
            who, at = answers[0].consumer_id, answers[0].at
            if who is not None:
                last[who] = max(last.get(who, 0.0), at)
        if now - last[VICTIM] > SILENT_S and any(now - at < SILENT_S for who, at in last.items() if who != VICTIM):
            return
        await asyncio.sleep(0.02)
