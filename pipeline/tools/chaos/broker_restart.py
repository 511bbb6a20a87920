"""Fault: the Kafka broker stops for a while and comes back on the same data directory."""

from __future__ import annotations

import asyncio
import time

from pipeline.tools.chaos.deployment import CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.steps import ChaosSizes, drain_events, port_released
from pipeline.tools.harness.errors import HarnessError


async def broker_restart(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """Stop the broker for `outage_s` and start it again on the same data directory.

    Two consumers, the sink and the harness's own producer and reader are up
    throughout and must reconnect by themselves: every request answered,
    every latency event a ClickHouse row, none twice.
    """
    broker = stage.broker
    if broker is None:
        raise HarnessError("broker-restart needs a broker of its own (Stage.broker)")
    device = CostModelDevice(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    before_s, after_s = 2.0, 3.0
    async with Deployment(stage, device, partitions=4) as d:
        d.consumer("c1")
        d.consumer("c2")
        d.sink()
        await d.warm_up(consumers=2)
        await d.sink_ready(sizes.answer_timeout_s)
        sending = asyncio.create_task(
            d.traffic.open_loop(int(sizes.rate_rps * (before_s + sizes.outage_s)), sizes.rate_rps)
        )
        await asyncio.sleep(before_s)
        fault_start = time.time()
        try:
            await asyncio.to_thread(broker.stop)
            await asyncio.sleep(max(0.0, sizes.outage_s - (time.time() - fault_start)))
        finally:
            await port_released(broker.port)
            await asyncio.to_thread(broker.start, 120.0)
        fault_end = time.time()
        await sending
        sending = asyncio.create_task(d.traffic.open_loop(int(sizes.rate_rps * after_s), sizes.rate_rps))
        events = await drain_events(d, sizes, sending)
        report = d.ledger.report(
            f"broker stopped {sizes.outage_s:g} s, restarted",
            1,
            fault_end=fault_end,
            duplicate_bound=None,
            events=events,
            details={
                "outage_s": round(fault_end - fault_start, 1),
                "events_recovery_s": None if events.caught_up is None else round(events.caught_up - fault_end, 1),
                **d.ledger.p99_by_phase(fault_start, fault_end),
            },
        )
        return report
