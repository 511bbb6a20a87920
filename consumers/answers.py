"""The one place that builds what the consumer writes: answers, dead letters and events.

`Held` is everything the loop keeps about one request between fetch and
answer (the engine only carries it as an opaque payload). `Answers` turns a
finished, expired or refused request into outbox `Message`s: its `Result`,
its `DeadLetter`, its `LatencyEvent`, and one `BatchEvent` per batch, with
every time in epoch ms on the consumer's wall clock.

Each answer also knows its fallbacks, so that no record the broker refuses
can stop the consumer (`consumers.delivery` applies them):

- a dead letter that would exceed the dead-letter topic's `max.message.bytes`
  keeps as much of the original as fits and says `truncated`; the size and
  SHA-256 of the whole original are always there;
- a result too large for its topic becomes an `error` answer saying so, and
  its latency event says `error` (reason `oversize`) too: an answer and its
  event share one `Verdict`, and the event is rebuilt from it when sent;
- a result for a client's `reply_topic` that cannot take it goes to the
  model's results topic with the reason in `reply_error`.

Every request that gets an answer gets one latency event, whatever its
outcome, with `reason` saying why it was not `ok`: `deadline` (expired),
`runner_error` (the runner failed on it alone), `oversize` (its answer did
not fit), or the rejection's reason (`schema`, `input_too_long`, ...). A
record refused before its id could be read is counted under the id
`record:<topic>/<partition>/<offset>`, the same on every re-delivery, so the
sink's dedup keeps counts exact. Duplicates get no event: the request they
repeat already has its one.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

import msgspec
from aiokafka.structs import TopicPartition

from consumers.intake import bounded
from consumers.runners.base import MemoryKind, Output
from pipeline.core.engine.decisions import Batch
from pipeline.core.kafka.client import Topics
from pipeline.core.kafka.outbox import Message
from pipeline.core.kafka.topic_limits import KAFKA_DEFAULT_MAX_MESSAGE_BYTES, TopicLimits, record_size
from schemas.messages import BatchEvent, DeadLetter, LatencyEvent, Outcome, Request, Result

_encode = msgspec.json.Encoder().encode

OVERSIZE = "oversize"
"""Reason of an answer shrunk to `error` because it did not fit its topic."""
DEADLINE = "deadline"
RUNNER_ERROR = "runner_error"


@dataclass(slots=True)
class Verdict:
    """A request's outcome as its answer finally went out: shared by the answer and its latency
    event, so an answer rebuilt as `error` on its way to the broker takes its event along."""

    outcome: Outcome
    reason: str = ""


def record_id(topic: str, partition: int, offset: int) -> str:
    """The id a record refused before its request id could be read is counted under."""
    return f"record:{topic}/{partition}/{offset}"


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
    device_mem_kind: MemoryKind


DECISION_FIELDS = (
    "cost",
    "reason",
    "window_ms",
    "hit_target",
    "target_size",
    "marked_count",
    "oldest_wait_ms",
    "queue_depth",
    "effective_cap",
    "cap_reason",
    "arrival_rate_per_s",
)
"""The engine's account of why a batch left (`DispatchRecord`), carried into its `BatchEvent` unchanged."""


class Answers:
    """Builders for one model's consumer; every one returns a `Message` ready for the outbox."""

    def __init__(self, model: str, consumer_id: str, topics: Topics, limits: TopicLimits) -> None:
        self.model = model
        self.consumer_id = consumer_id
        self.topics = topics
        self.results_topic = topics.results(model)
        self._limits = limits

    # ---- results ---------------------------------------------------------------

    def result(
        self,
        request_id: str,
        reply_topic: str | None,
        outcome: Outcome,
        *,
        enqueue_ms: int,
        done_ms: int,
        batch_id: int | None = None,
        output: Output | None = None,
        error: str | None = None,
        verdict: Verdict | None = None,
    ) -> Message:
        """The answer; `verdict` learns if it is rebuilt as an `error` (too large for its topic)."""
        result = Result(
            id=request_id,
            model=self.model,
            outcome=outcome,
            embedding=output.embedding if output else None,
            text=output.text if output else None,
            token_ids=output.token_ids if output else None,
            error=error,
            batch_id=batch_id,
            consumer_id=self.consumer_id,
            enqueue_ms=enqueue_ms,
            done_ms=done_ms,
        )
        return self._result_message(result, reply_topic, verdict or Verdict(outcome))

    def answered(
        self,
        held: Held,
        verdict: Verdict,
        done_ms: int,
        *,
        batch_id: int | None = None,
        output: Output | None = None,
        error: str | None = None,
    ) -> Message:
        """The Result of a request that was admitted (ran, failed or expired)."""
        request = held.request
        return self.result(
            request.id,
            request.reply_topic,
            verdict.outcome,
            enqueue_ms=held.enqueue_ms,
            done_ms=done_ms,
            batch_id=batch_id,
            output=output,
            error=error,
            verdict=verdict,
        )

    def _result_message(self, result: Result, reply_topic: str | None, verdict: Verdict) -> Message:
        topic = reply_topic or self.results_topic
        elsewhere = topic != self.results_topic

        def fit(limit: int) -> Message:
            size = len(_encode(result))
            error = f"the answer ({size} bytes) is larger than max.message.bytes ({limit}) of topic {topic}"
            smaller = msgspec.structs.replace(
                result, outcome="error", embedding=None, text=None, token_ids=None, error=error
            )
            if result.outcome != "error":
                verdict.outcome, verdict.reason = "error", OVERSIZE
            return self._result_message(smaller, reply_topic, verdict)

        def reroute(why: str) -> Message:
            moved = msgspec.structs.replace(result, reply_error=bounded(f"reply_topic {topic!r}: {why}"))
            return self._result_message(moved, None, verdict)

        return Message(topic, result.id.encode(), _encode(result), fit=fit, reroute=reroute if elsewhere else None)

    # ---- dead letters ------------------------------------------------------------

    def dead_letter(
        self,
        reason: str,
        detail: str,
        *,
        source: TopicPartition,
        offset: int,
        timestamp_ms: int,
        original: bytes,
        request_id: str | None,
    ) -> Message:
        """A dead letter with as much of `original` as the dead-letter topic takes."""
        base = DeadLetter(
            reason=reason,
            detail=detail,
            topic=source.topic,
            partition=source.partition,
            offset=offset,
            timestamp_ms=timestamp_ms,
            consumer_id=self.consumer_id,
            original_b64="",
            original_size=len(original),
            original_sha256=hashlib.sha256(original).hexdigest(),
            request_id=request_id,
        )
        key = request_id.encode() if request_id else None
        topic = self.topics.dlq

        def fit(limit: int) -> Message:
            room = limit - record_size(key, _encode(base), None)
            keep = max(room, 0) // 4 * 3
            if len(original) <= keep:
                letter = msgspec.structs.replace(base, original_b64=base64.b64encode(original).decode("ascii"))
            else:
                cut = base64.b64encode(original[:keep]).decode("ascii")
                letter = msgspec.structs.replace(base, original_b64=cut, truncated=True)
            return Message(topic, key, _encode(letter), fit=fit)

        return fit(self._limits.cached(topic) or KAFKA_DEFAULT_MAX_MESSAGE_BYTES)

    def dead_letter_of(self, held: Held, reason: str, detail: str) -> Message:
        return self.dead_letter(
            reason,
            detail,
            source=held.tp,
            offset=held.offset,
            timestamp_ms=held.enqueue_ms,
            original=held.raw,
            request_id=held.request.id,
        )

    # ---- events ------------------------------------------------------------------

    def latency(
        self,
        held: Held,
        verdict: Verdict,
        timing: BatchTiming,
        *,
        batch_id: int,
        batch_size: int,
        marked: bool,
        priority: int,
        output: Output | None = None,
    ) -> Message:
        """The request's event, as its answer's `verdict` stands when it is sent."""
        first_ms, last_ms = _token_times(output)  # a row stopped by its deadline generated too
        event = LatencyEvent(
            request_id=held.request.id,
            model=self.model,
            consumer_id=self.consumer_id,
            outcome=verdict.outcome,
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
            tokens_out=held.tokens_out if output is not None else 0,
            device_mem_bytes=timing.device_mem_bytes,
            device_mem_kind=timing.device_mem_kind,
            partition=held.tp.partition,
            offset=held.offset,
            forwarded=held.forwarded_in,
            warmup=held.request.warmup,
            first_token_ms=first_ms,
            last_token_ms=last_ms,
            reason=verdict.reason,
            trace_index=-1 if held.request.trace_index is None else held.request.trace_index,
        )
        return self._event_message(event, verdict)

    def refused(
        self,
        reason: str,
        *,
        request_id: str | None,
        source: TopicPartition,
        offset: int,
        timestamp_ms: int,
        fetch_ms: int,
        done_ms: int,
        warmup: bool = False,
        trace_index: int | None = None,
        verdict: Verdict | None = None,
    ) -> Message:
        """The latency event of a refused record (outcome `rejected`, the rejection's reason): under
        its request id, or `record_id` when it had none."""
        enqueue = timestamp_ms if timestamp_ms > 0 else fetch_ms
        event = LatencyEvent(
            request_id=request_id or record_id(source.topic, source.partition, offset),
            model=self.model,
            consumer_id=self.consumer_id,
            outcome="rejected",
            enqueue_ms=enqueue,
            fetch_ms=fetch_ms,
            dispatch_ms=fetch_ms,
            compute_start_ms=done_ms,
            compute_end_ms=done_ms,
            produce_ms=done_ms,
            wait_ms=float(max(0, fetch_ms - enqueue)),
            compute_ms=0.0,
            e2e_ms=float(max(0, done_ms - enqueue)),
            batch_id=-1,
            batch_size=0,
            tail_marked=False,
            priority=0,
            tokens_in=0,
            tokens_out=0,
            device_mem_bytes=0,
            device_mem_kind="none",
            partition=source.partition,
            offset=offset,
            warmup=warmup,
            reason=reason,
            trace_index=-1 if trace_index is None else trace_index,
        )
        return self._event_message(event, verdict or Verdict("rejected", reason))

    def _event_message(self, event: LatencyEvent, verdict: Verdict) -> Message:
        """The event, rebuilt from `verdict` whenever it is sent (`Message.revise`)."""

        def revise() -> Message:
            now = msgspec.structs.replace(event, outcome=verdict.outcome, reason=verdict.reason)
            return Message(self.topics.latency_events, event.request_id.encode(), _encode(now), revise=revise)

        return revise()

    def batch(
        self, batch: Batch, timing: BatchTiming, *, compute_ms: float, tokens_in: int, tokens_out: int
    ) -> Message:
        event = BatchEvent(
            batch_id=batch.batch_id,
            model=self.model,
            consumer_id=self.consumer_id,
            dispatch_ms=timing.dispatch_ms,
            size=batch.size,
            compute_ms=compute_ms,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            device_mem_bytes=timing.device_mem_bytes,
            device_mem_kind=timing.device_mem_kind,
            **{name: getattr(batch.record, name) for name in DECISION_FIELDS},
        )
        return Message(self.topics.batch_events, None, _encode(event))


def _token_times(output: Output | None) -> tuple[int, int]:
    """The runner's first/last token stamps as whole epoch ms (0, 0 when it decoded none).

    Floored, like every other stamp of the event, so enqueue <= first <= last <= produce holds."""
    if output is None or output.first_token_ms is None:
        return 0, 0
    first = int(output.first_token_ms)
    last = int(output.last_token_ms) if output.last_token_ms is not None else first
    return first, max(first, last)
