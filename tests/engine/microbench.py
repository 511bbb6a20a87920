"""Engine micro-benchmark (not a test): pure offer + poll + completed throughput.

Run: python -m tests.engine.microbench [requests]
Drives one engine with a virtual clock at ~2 arrivals per 0.1 ms against a
device whose batch takes 4 + 0.05 x b ms, so batches form from backlog, the
cost curve learns, marking and the rolling p50 are live. Timed in process CPU
time, so other work on a shared machine does not count against the engine.
"""

from __future__ import annotations

import sys
import time

from pipeline.core.config import BatchProfile
from pipeline.core.engine import BatchingEngine, PendingRequest


def run(total: int) -> float:
    engine = BatchingEngine(BatchProfile(max_inflight_batches=2))
    now = 0.0
    inflight: list[tuple[float, object, float]] = []
    offered = 0
    started = time.process_time()
    while offered < total or engine.pending or inflight:
        now += 0.1
        for _ in range(2):
            if offered < total:
                engine.offer(PendingRequest(str(offered), now, priority=offered % 3), now)
                offered += 1
        while inflight and inflight[0][0] <= now:
            done, batch, compute = inflight.pop(0)
            engine.completed(batch, done, compute)  # type: ignore[arg-type]
        while True:
            decision = engine.poll(now)
            if decision.batch is None:
                break
            compute = 4.0 + 0.05 * decision.batch.size
            inflight.append((now + compute, decision.batch, compute))
            inflight.sort(key=lambda item: item[0])
    elapsed = time.process_time() - started
    return total / elapsed


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    rates = [run(n) for _ in range(3)]
    print(
        f"engine: {max(rates):,.0f} requests/s best of 3 "
        f"(median {sorted(rates)[1]:,.0f}; CPU time of offer+poll+completed incl. the driver loop, "
        f"{n:,} requests)"
    )
