"""From a Kafka record to its LatencyEvent: what the consumer remembers per request.

`Held` is everything the loop keeps about one request between fetch and
answer (the engine only carries it as an opaque payload). The two builders
turn a finished request or batch into the wire events that ClickHouse stores,
with every time in epoch ms on the consumer's wall clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiokafka.structs import TopicPartition

from pipeline.engine.decisions import Batch
from schemas.messages import BatchEvent, LatencyEvent, Outcome, Request


@dataclass(slots=True, eq=False)
class Held:
    """One fetched request, from the record it came in to the answer it gets."""

    request: Request
    raw: bytes
    """The record value as received: dead letters and forwards carry it verbatim."""
    tp: TopicPartition
    offset: int
    enqueue_ms: int
    """Record CreateTime, or the original CreateTime carried by a tail forward."""
    fetch_ms: int
    tokens_in: int
    tokens_out: int
    """Expected output tokens at intake; replaced by the real count after the run."""
    forwarded_in: bool = False
    """Arrived as a tail forward from another consumer (never forwarded again)."""


@dataclass(slots=True)
class BatchTiming:
    dispatch_ms: int
    compute_start_ms: int
    compute_end_ms: int
    produce_ms: int
    device_mem_bytes: int
    device_mem_kind: str


def latency_event(
    held: Held,
    *,
    model: str,
    consumer_id: str,
    outcome: Outcome,
    timing: BatchTiming,
    batch_id: int,
    batch_size: int,
    marked: bool,
    priority: int,
) -> LatencyEvent:
    return LatencyEvent(
        request_id=held.request.id,
        model=model,
        consumer_id=consumer_id,
        outcome=outcome,
        enqueue_ms=held.enqueue_ms,
        fetch_ms=held.fetch_ms,
        dispatch_ms=timing.dispatch_ms,
        compute_start_ms=timing.compute_start_ms,
        compute_end_ms=timing.compute_end_ms,
        produce_ms=timing.produce_ms,
        wait_ms=float(max(0, timing.dispatch_ms - held.enqueue_ms)),
        compute_ms=float(timing.compute_end_ms - timing.compute_start_ms),
        e2e_ms=float(max(0, timing.produce_ms - held.enqueue_ms)),
        batch_id=batch_id,
        batch_size=batch_size,
        tail_marked=marked,
        priority=priority,
        tokens_in=held.tokens_in,
        tokens_out=held.tokens_out if outcome == "ok" else 0,
        device_mem_bytes=timing.device_mem_bytes,
        device_mem_kind=timing.device_mem_kind,  # type: ignore[arg-type]
        partition=held.tp.partition,
        offset=held.offset,
        forwarded=held.forwarded_in,
    )


def batch_event(
    batch: Batch,
    *,
    model: str,
    consumer_id: str,
    target_size: int,
    compute_ms: float,
    tokens_in: int,
    tokens_out: int,
    timing: BatchTiming,
) -> BatchEvent:
    rec = batch.record
    return BatchEvent(
        batch_id=batch.batch_id,
        model=model,
        consumer_id=consumer_id,
        dispatch_ms=timing.dispatch_ms,
        size=batch.size,
        cost=rec.cost,
        reason=rec.reason,
        window_ms=rec.window_ms,
        hit_target=rec.hit_target,
        target_size=target_size,
        marked_count=rec.marked_count,
        oldest_wait_ms=rec.oldest_wait_ms,
        queue_depth=rec.queue_depth,
        effective_cap=rec.effective_cap,
        cap_reason=rec.cap_reason,
        arrival_rate_per_s=rec.arrival_rate_per_s,
        compute_ms=compute_ms,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        device_mem_bytes=timing.device_mem_bytes,
        device_mem_kind=timing.device_mem_kind,
    )
