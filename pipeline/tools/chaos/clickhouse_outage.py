"""Fault: ClickHouse refuses every insert for a while, then recovers."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

from pipeline.tools.chaos.deployment import CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport, percentile
from pipeline.tools.chaos.steps import ChaosSizes, drain_events
from pipeline.tools.harness.errors import HarnessError


class StorageFreeze:
    """A ClickHouse outage for the embedded engine: every table directory made immutable.

    chDB runs inside the sink's own process, so there is no connection to
    cut and no server to stop. Instead the table directories under the data
    dir get the immutable attribute (`chattr +i`, root on ext4/xfs): every
    insert then fails inside the real engine (it cannot create its part
    directory), reads still answer, and the sink sees exactly what a
    ClickHouse that refuses writes looks like until `thaw()`.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.frozen: list[Path] = []

    def freeze(self) -> None:
        tables = sorted(p for p in self.data_dir.glob("store/*/*") if p.is_dir())
        if not tables:
            raise HarnessError(f"no table directories under {self.data_dir}/store to freeze")
        for table in tables:
            self._chattr("+i", table)
            self.frozen.append(table)

    def thaw(self) -> None:
        while self.frozen:
            self._chattr("-i", self.frozen.pop())

    @staticmethod
    def _chattr(flag: str, path: Path) -> None:
        try:
            done = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise HarnessError("chattr is not installed: the ClickHouse outage cannot be injected") from None
        if done.returncode != 0:
            raise HarnessError(f"chattr {flag} {path} failed (needs root and ext4/xfs): {done.stderr.strip()}")


async def clickhouse_outage(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """ClickHouse refuses every insert for `outage_s` while traffic flows, then recovers.

    The running sink must retry by itself (no restart); inference must go on
    at full rate meanwhile; afterwards every latency event must be a row, none
    twice. The outage is injected with `StorageFreeze` (see there why).
    """
    device = CostModelDevice(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    before_s, after_s = 2.0, 4.0
    count = int(sizes.rate_rps * (before_s + sizes.outage_s + after_s))
    async with Deployment(stage, device, partitions=4, clickhouse={"insert_retry_max_s": 1.0}) as d:
        d.consumer("only")
        d.sink()
        await d.warm_up(consumers=1)
        await d.sink_ready(sizes.answer_timeout_s)
        sending = asyncio.create_task(d.traffic.open_loop(count, sizes.rate_rps))
        await asyncio.sleep(before_s)
        freeze = StorageFreeze(d.clickhouse_dir)
        try:
            freeze.freeze()
            outage_start = time.time()
            await asyncio.sleep(sizes.outage_s)
            d.check_alive()
            sink_members = await d.sink_members()
            stalled = await d.events_caught_up(0.5) is None
        finally:
            freeze.thaw()
        outage_end = time.time()
        events = await drain_events(d, sizes, sending)
        during = [rid for rid, at in d.ledger.sent.items() if outage_start <= at <= outage_end - 1.0]
        served_in_time = [
            rid for rid in during if d.ledger.results.get(rid) and d.ledger.results[rid][0].at <= outage_end
        ]
        e2e = {rid: float(a[0].done_ms - a[0].enqueue_ms) for rid, a in d.ledger.results.items()}
        p99_during = percentile([e2e[r] for r in during if r in e2e], 99)
        p99_outside = percentile(
            [e2e[r] for r, at in d.ledger.sent.items() if not outage_start <= at <= outage_end and r in e2e], 99
        )
        failures: list[str] = []
        if sink_members < 1:
            failures.append("the sink was not in its consumer group during the outage")
        if not stalled:
            failures.append("the sink caught up during the outage: ClickHouse did not really refuse inserts")
        if len(served_in_time) < 0.95 * len(during):
            failures.append(
                f"only {len(served_in_time)} of {len(during)} requests sent during the outage were served in it"
            )
        if events.caught_up is None:
            failures.append("the sink did not load the outage's events after ClickHouse recovered")
        report = d.ledger.report(
            f"ClickHouse refusing inserts {sizes.outage_s:g} s",
            1,
            fault_end=None,
            failures=failures,
            events=events,
            details={
                "outage_s": round(outage_end - outage_start, 1),
                "served_during_outage": f"{len(served_in_time)}/{len(during)}",
                "e2e_p99_during_ms": round(p99_during, 1),
                "e2e_p99_outside_ms": round(p99_outside, 1),
            },
        )
        report.recovery_s = events.recovery_after(outage_end)
        return report
