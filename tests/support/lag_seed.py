"""Deterministic consumer-lag samples for the seeded store: what consumers of each model would
have recorded over the seeded range, so the lag panels have rows to draw."""

from __future__ import annotations

import math

from schemas.messages import LagEvent, PartitionLag

INTERVAL_MS = 5_000


def lag_samples(models: tuple[str, ...], time_from_ms: int, time_to_ms: int) -> list[LagEvent]:
    """Two consumers per model, two partitions each, one sample every 5 s; the lag swells and drains."""
    events = []
    for m, model in enumerate(models):
        for c in range(2):
            consumer = f"seed-{model}-{c}"
            for n, ts in enumerate(range(time_from_ms + c * 1_000, time_to_ms, INTERVAL_MS)):
                wave = (1 + math.sin(n / 9 + m)) / 2
                parts = []
                for p in (2 * c, 2 * c + 1):
                    lag = int(wave * 40 * (p + 1))
                    end = 10_000 + n * 20
                    age = wave * 800.0 * (p + 1) if lag else 0.0
                    parts.append(PartitionLag(f"seed.requests.{model}", p, end, end - lag, lag,
                                              int(ts - age) if lag else 0, age))  # fmt: skip
                events.append(LagEvent(
                    ts_ms=ts, model=model, consumer_id=consumer, group=f"seed.consumers.{model}", partitions=parts,
                    queue=int(wave * 64), inflight=1, window_ms=2.0 + 10 * wave, effective_cap=32 - 8 * c,
                    cap_reason="knee", marked_share=0.02 * wave, arrival_rate_per_s=100.0 * wave, batches=n * 3,
                    last_batch_ms=ts - 100, dead_letters=n // 10,
                ))  # fmt: skip
    return events
