"""Fault: arrivals at several times one consumer's capacity, every request with a deadline."""

from __future__ import annotations

import asyncio
import time

from pipeline.tools.chaos.deployment import CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport, percentile
from pipeline.tools.chaos.steps import ChaosSizes, settle_answers, stop_task
from pipeline.tools.harness.processes import Proc

DISPATCH_SLACK_MS = 5
"""Event times are whole milliseconds on one clock; this absorbs the rounding."""


class RssSampler:
    """Peak resident memory of some processes, sampled in the background."""

    def __init__(self, procs: list[Proc], every_s: float = 0.2) -> None:
        self._procs = procs
        self._every_s = every_s
        self.peak_bytes = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            for proc in self._procs:
                self.peak_bytes = max(self.peak_bytes, proc.rss_bytes())
            await asyncio.sleep(self._every_s)

    async def stop(self) -> None:
        await stop_task(self._task)


async def overload(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """Arrivals at `overload_factor` x one consumer's capacity, every request with a deadline.

    The consumer must keep its memory bounded (Kafka holds the backlog, the
    fetch loop pauses), answer `expired` rather than run a request past its
    deadline, keep the latency of what it does run bounded, and drain the
    backlog once arrivals stop.
    """
    device = CostModelDevice(a_ms=20.0, c_ms=4.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    rate = device.capacity_rps * sizes.overload_factor
    count = int(rate * sizes.overload_s)
    timeout_ms = sizes.overload_timeout_ms
    async with Deployment(stage, device, partitions=4, consumer={"max_queue": 256}, collect_latency_events=True) as d:
        proc = d.consumer("only")
        await d.warm_up(consumers=1)
        baseline_rss = proc.rss_bytes()
        sampler = RssSampler([proc])
        sampler.start()
        started = time.time()
        await d.traffic.open_loop(count, rate, timeout_ms=timeout_ms)
        fault_end = time.time()
        await settle_answers(d, sizes, linger_s=1.0)
        await sampler.stop()
        d.check_alive()
        ok = {rid: answers[0] for rid, answers in d.ledger.results.items() if answers[0].outcome == "ok"}
        e2e_ok = [float(a.done_ms - a.enqueue_ms) for a in ok.values()]
        late_bound_ms = timeout_ms + device.batch_ms(device.hard_cap) + 500.0
        slow = [x for x in e2e_ok if x > late_bound_ms]
        started_late = [
            rid
            for rid, a in ok.items()
            if d.ledger.dispatched_ms.get(rid, 0) > a.enqueue_ms + timeout_ms + DISPATCH_SLACK_MS
        ]
        untimed = [rid for rid in ok if rid not in d.ledger.dispatched_ms]
        p99 = percentile(e2e_ok, 99)
        in_window = [a for a in ok.values() if a.done_ms / 1000.0 <= fault_end]
        ok_rps = len(in_window) / max(fault_end - started, 1e-9)
        growth_mb = (sampler.peak_bytes - baseline_rss) / 2**20
        failures: list[str] = []
        outcomes = d.ledger.outcomes()
        if not outcomes.get("expired"):
            failures.append("no request was answered `expired` at 3x capacity")
        if started_late:
            failures.append(f"{len(started_late)} requests were dispatched after their deadline instead of expiring")
        if untimed:
            failures.append(f"{len(untimed)} ok results have no latency event to check their dispatch time")
        if p99 > late_bound_ms:
            failures.append(f"p99 of accepted requests {p99:.0f} ms above {late_bound_ms:.0f} ms")
        if growth_mb > 150:
            failures.append(f"consumer RSS grew {growth_mb:.0f} MB under overload (bound 150 MB)")
        if ok_rps < 0.5 * device.capacity_rps:
            failures.append(
                f"served {ok_rps:.0f} ok/s under overload, under half the capacity {device.capacity_rps:.0f}/s"
            )
        return d.ledger.report(
            f"overload {sizes.overload_factor:g}x capacity for {sizes.overload_s:g} s",
            1,
            fault_end=fault_end,
            failures=failures,
            details={
                "capacity_rps": round(device.capacity_rps, 1),
                "offered_rps": round(rate, 1),
                "ok_rps_during": round(ok_rps, 1),
                "peak_rss_mb": round(sampler.peak_bytes / 2**20, 1),
                "rss_growth_mb": round(growth_mb, 1),
                "ok_p50_ms": round(percentile(e2e_ok, 50), 1),
                "ok_p99_ms": round(p99, 1),
                "ok_max_ms": round(max(e2e_ok, default=0.0), 1),
                "late_bound_ms": round(late_bound_ms, 1),
                "ok_over_late_bound": len(slow),
                "dispatched_after_deadline": len(started_late),
            },
        )
