"""One moment's decision: the engine polled while the device has free slots.

The loop asks on every arrival, completion and wake-up, never on a fixed
tick. One poll starts at most one batch, so the engine is asked again while
slots are free (each batch it starts takes one); what it expired on the way
is answered `expired` and never runs, and the last poll says when to ask
again even if nothing arrives. Pure: the time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.engine.decisions import Batch, BatchPolicy, PendingRequest


@dataclass
class Step:
    """What the engine decided at one moment (`poll_engine`)."""

    batches: list[Batch] = field(default_factory=list)
    expired: list[PendingRequest] = field(default_factory=list)
    wake_at_ms: float | None = None


def poll_engine(engine: BatchPolicy, now_ms: float, computing: int, max_inflight: int, backlog: int) -> Step:
    """Every batch the engine starts at `now_ms` while device slots are free (`computing` taken),
    the requests it expired (answered, never run), and when to ask again."""
    step = Step()
    for _ in range(max_inflight + 1):
        decision = engine.poll(now_ms, device_free=computing < max_inflight, backlog=backlog)
        step.expired.extend(decision.expired)
        step.wake_at_ms = decision.wake_at_ms
        if decision.batch is None:
            break
        step.batches.append(decision.batch)
        computing += 1
    return step
