"""Fault: SIGKILL the sink while events flow, and restart it."""

from __future__ import annotations

import asyncio
import time

from pipeline.tools.chaos.deployment import CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.steps import ChaosSizes, drain_events


async def sink_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL the sink while events flow (`sink_kills` times), restarting it each time.

    Events inserted but not yet committed are delivered again to the new sink:
    every latency event must be a ClickHouse row, and none twice.
    """
    device = CostModelDevice(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    kills = sizes.sink_kills
    async with Deployment(stage, device, partitions=4) as d:
        d.consumer("only")
        d.sink()
        await d.warm_up(consumers=1)
        await d.sink_ready(sizes.answer_timeout_s)
        sending = asyncio.create_task(d.traffic.open_loop(sizes.requests, sizes.rate_rps))
        gap_s = sizes.requests / sizes.rate_rps / (kills + 1)
        fault_end = time.time()
        for _ in range(kills):
            await asyncio.sleep(gap_s)
            d.check_alive()
            d.sinks[-1].kill()
            await asyncio.sleep(1.0)
            d.sink()
            fault_end = time.time()
        events = await drain_events(d, sizes, sending)
        failures = []
        if events.caught_up is None:
            failures.append("the restarted sink did not catch up with the events produced before its restart")
        report = d.ledger.report(
            "sink SIGKILL + restart",
            kills,
            fault_end=None,
            failures=failures,
            events=events,
        )
        report.recovery_s = events.recovery_after(fault_end)
        return report
