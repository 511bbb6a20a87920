"""Fault: consumers join and leave the group again and again while traffic flows."""

from __future__ import annotations

import asyncio
import time

from pipeline.tools.chaos.deployment import CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport, Ledger, percentile
from pipeline.tools.chaos.steps import ChaosSizes, settle_answers


async def rebalance_storm(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """Consumers join and leave (SIGTERM) every few seconds while traffic flows.

    One consumer stays up throughout; around it others come and go, so the
    group rebalances again and again. The pace follows the guests, not a
    fixed clock: a new process needs seconds to start on a busy machine, so
    every `storm_period_s` the harness either stops the oldest guest that is
    serving (it has answered a request) or starts a new one. A leaving
    consumer finishes or abandons its work on revoke and commits only what it
    answered: nothing may be lost and, with clean leaves, nothing answered twice.
    """
    device = CostModelDevice(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    async with Deployment(stage, device, partitions=6) as d:
        d.consumer("anchor")
        await d.warm_up(consumers=1)
        started = time.monotonic()
        storm_end, hard_end = started + sizes.storm_s, started + 2 * sizes.storm_s
        calm = asyncio.Event()
        sending = asyncio.create_task(
            d.traffic.open_loop(int(sizes.rate_rps * 2 * sizes.storm_s), sizes.rate_rps, until=calm.is_set)
        )
        guests: list[str] = []
        leaves = 0

        def storming() -> bool:
            """Until storm_s is over and (on a slow machine, up to twice as long) a join and a leave happened."""
            now = time.monotonic()
            joined = sum(1 for g in guests if _has_answered(d.ledger, g))
            return now < storm_end or (now < hard_end and (joined < 2 or leaves < 1))

        while storming():
            d.check_alive()
            serving = [g for g in guests if d.consumers[g].meant_up and _has_answered(d.ledger, g)]
            starting = [g for g in guests if d.consumers[g].meant_up and g not in serving]
            if len(serving) >= 2:
                d.consumers[serving[0]].request_stop()
                leaves += 1
            elif len(starting) < 2:
                name = f"guest{len(guests)}"
                d.consumer(name)
                guests.append(name)
            await asyncio.sleep(sizes.storm_period_s)
        fault_end = time.time()
        calm.set()
        await sending
        await settle_answers(d, sizes)
        d.check_alive()
        answered_by: dict[str, int] = {}
        for answers in d.ledger.results.values():
            name = answers[0].consumer_id or "?"
            answered_by[name] = answered_by.get(name, 0) + 1
        joins = sum(1 for g in guests if g in answered_by)
        e2e = [float(a[0].done_ms - a[0].enqueue_ms) for a in d.ledger.results.values()]
        failures = []
        if joins < 2 or leaves < 1:
            failures.append(f"only {joins} guests served and {leaves} left ({answered_by}): no storm happened")
        return d.ledger.report(
            "rebalance storm (join/leave)",
            joins + leaves,
            fault_end=fault_end,
            failures=failures,
            details={
                "joins": joins,
                "leaves": leaves,
                "answered_by": answered_by,
                "e2e_p99_ms": round(percentile(e2e, 99), 1),
            },
        )


def _has_answered(ledger: Ledger, consumer_id: str) -> bool:
    return any(answers[0].consumer_id == consumer_id for answers in ledger.results.values())
