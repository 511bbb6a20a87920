"""Shared builders for the engine tests: requests and a tiny virtual-clock device."""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

from pipeline.core.engine import Batch, BatchingEngine, DispatchRecord, PendingRequest

_ids = count()


def request(
    enqueue_ms: float,
    *,
    priority: int = 0,
    cost: int = 1,
    deadline_ms: float | None = None,
    name: str | None = None,
) -> PendingRequest:
    return PendingRequest(
        request_id=name if name is not None else f"r{next(_ids)}",
        enqueue_ms=enqueue_ms,
        cost=cost,
        priority=priority,
        deadline_ms=deadline_ms,
    )


def run_saturated(
    engine: BatchingEngine,
    batch_ms: Callable[[int, int], float],
    batches: int,
    *,
    arrivals_per_batch: int = 60,
) -> list[DispatchRecord]:
    """Keep the queue above the cap and run `batches` batches back to back on one device.

    `batch_ms(size, batch_index)` is the device's compute time: the test's
    cost curve, which the engine only learns through `completed()`.
    """
    now = 0.0
    records: list[DispatchRecord] = []
    for index in range(batches):
        while engine.pending < arrivals_per_batch:
            engine.offer(request(now), now)
        decision = engine.poll(now)
        batch: Batch | None = decision.batch
        assert batch is not None
        records.append(batch.record)
        compute = batch_ms(batch.record.cost, index)
        now += compute
        engine.completed(batch, now, compute)
    return records
