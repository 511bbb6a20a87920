"""What every fault scenario shares beside its deployment: how hard it pushes (`ChaosSizes`) and the
steps that end one (wait for the answers, let the sink catch up and count its rows)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pipeline.tools.chaos.deployment import Deployment
from pipeline.tools.chaos.ledger import EventTally
from pipeline.tools.devtools.broker_process import port_is_free


@dataclass(frozen=True)
class ChaosSizes:
    """How long and how hard each scenario pushes. `quick()` is what the test suite uses."""

    rate_rps: float = 80.0
    """Steady arrival rate of the scenarios that are not about overload."""
    requests: int = 1600
    """Requests of the steady scenarios (duration = requests / rate)."""
    outage_s: float = 20.0
    """How long the broker, or ClickHouse, stays away."""
    freeze_s: float = 30.0
    """How long `broker-freeze` keeps a cluster's broker SIGSTOPped."""
    overload_s: float = 60.0
    overload_factor: float = 3.0
    """Arrival rate as a multiple of one consumer's capacity."""
    overload_timeout_ms: int = 2000
    """Deadline (relative timeout) carried by every overload request."""
    sink_kills: int = 2
    """Times the sink is SIGKILLed (each restart waits out the dead member's session)."""
    storm_s: float = 40.0
    storm_period_s: float = 3.0
    """How often the storm acts: stop a serving guest, or start a new one."""
    answer_timeout_s: float = 120.0
    """Longest a scenario waits for the last answer before declaring the rest lost."""

    @classmethod
    def quick(cls) -> ChaosSizes:
        return cls(rate_rps=60.0, requests=600, outage_s=10.0, freeze_s=8.0, overload_s=15.0, sink_kills=1,
                   storm_s=20.0, storm_period_s=2.0, answer_timeout_s=90.0)  # fmt: skip


async def settle_answers(d: Deployment, sizes: ChaosSizes, linger_s: float = 2.0) -> None:
    """Wait for every sent request to be answered, then a little longer for late duplicates."""
    await d.traffic.flush()
    await d.collector.wait_answered(list(d.ledger.sent), sizes.answer_timeout_s)
    await asyncio.sleep(linger_s)


async def drain_events(d: Deployment, sizes: ChaosSizes, sending: asyncio.Task[Any]) -> EventTally:
    """After a fault on the events path: wait for the sink to catch up with what was produced so
    far, let the traffic finish and every answer arrive, then stop the sink and count its rows."""
    target = await d.latency_end_offsets()
    caught_up = await d.events_caught_up(sizes.answer_timeout_s, target)
    await sending
    await settle_answers(d, sizes)
    d.check_alive()
    await d.events_caught_up(sizes.answer_timeout_s)
    for sink in d.sinks:
        sink.terminate()
    lost, double, details = d.event_accounting(await d.clickhouse_rows())
    return EventTally(caught_up, lost, double, details)


async def port_released(port: int, timeout_s: float = 30.0) -> None:
    """A stopped broker's listener port may linger a moment; its restart needs it free."""
    deadline = time.monotonic() + timeout_s
    while not port_is_free(port) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it is gone."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
