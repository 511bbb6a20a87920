"""What each way a request's life can end publishes, and the counts it adds.

Three endings, each a `Reply` for the publisher: a batch the device
finished (a Result per request, a dead letter too for a request the runner
failed on alone, a LatencyEvent each and one BatchEvent), requests the
engine expired before they could run (an `expired` Result and event, never
dispatched: their deadline passed, or the engine shed them at once because
they could no longer finish in time, and the reason says which), and records refused at admission (a dead letter, and a
`rejected` Result and event when they carry an id; duplicates get only the
dead letter, since the first answer stands). The records themselves are
built by `consumers.answers`; this module decides which ones. No I/O, no
clock: the loop passes the times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from aiokafka import ConsumerRecord, TopicPartition

from consumers.answers import DEADLINE, RUNNER_ERROR, Answers, BatchTiming, Held, Verdict
from consumers.intake import Rejection
from consumers.runners.base import Output
from consumers.stats import ConsumerStats
from pipeline.core.engine.decisions import Batch, PendingRequest
from pipeline.core.engine.shedding import CANNOT_MEET_SLO
from pipeline.core.kafka.outbox import Message


@dataclass
class Reply:
    """Records to publish, and what their publication answers."""

    messages: list[Message] = field(default_factory=list)
    answered: list[Held] = field(default_factory=list)
    """Admitted requests these records answer (their offsets, and their ids as answered)."""
    offsets: list[tuple[TopicPartition, int]] = field(default_factory=list)
    """Records answered that never became requests (refused at admission)."""

    @property
    def places(self) -> list[tuple[TopicPartition, int]]:
        """Every source record this reply answers, once it is on the broker."""
        return [(held.tp, held.offset) for held in self.answered] + self.offsets


def expiry_text(request: PendingRequest) -> str:
    """The `error` of an expired request's Result: why it never ran (engine/shedding.py)."""
    if request.expiry in (None, DEADLINE):
        return "deadline passed before the request could run"
    objective = "SLO" if request.expiry == CANNOT_MEET_SLO else "deadline"
    return (
        f"{request.expiry}: shed before running, the queue ahead and the batch time put its finish at "
        f"{request.predicted_done_ms:.0f} ms, past its {objective} ({request.finish_by_ms:.0f} ms, epoch)"
    )


class Outcomes:
    def __init__(self, answers: Answers, stats: ConsumerStats) -> None:
        self._answers = answers
        self._stats = stats

    def of_batch(
        self,
        batch: Batch,
        outputs: dict[int, Output],
        failures: dict[int, str],
        timing: BatchTiming,
        compute_ms: float,
    ) -> Reply:
        answers, stats = self._answers, self._stats
        reply = Reply()
        messages = reply.messages
        tokens_in = tokens_out = 0
        done = timing.produce_ms
        for index, pr in enumerate(batch.requests):
            held: Held = pr.payload
            output = outputs.get(index)
            if output is None:
                error = failures.get(index, "runner returned no output")
                messages.append(answers.dead_letter_of(held, RUNNER_ERROR, error))
                stats.dead_letters += 1
                verdict = Verdict("error", RUNNER_ERROR)
                messages.append(answers.answered(held, verdict, done, batch_id=batch.batch_id, error=error))
            else:
                held.tokens_out = output.tokens_out
                tokens_in += held.tokens_in
                tokens_out += output.tokens_out
                verdict = Verdict("expired", output.refused or DEADLINE) if output.expired else Verdict("ok")
                error = None
                if output.refused:
                    error = "refused before its prefill: it could not end by its deadline at the current time per step"
                elif output.expired:
                    error = f"deadline passed after {output.tokens_out} generated tokens (the text so far)"
                messages.append(
                    answers.answered(held, verdict, done, batch_id=batch.batch_id, output=output, error=error)
                )
            messages.append(
                answers.latency(
                    held,
                    verdict,
                    timing,
                    batch_id=batch.batch_id,
                    batch_size=batch.size,
                    marked=pr.marked,
                    priority=pr.priority,
                    output=output,
                )
            )
            reply.answered.append(held)
            stats.answered[verdict.outcome] += 1
        messages.append(answers.batch(batch, timing, compute_ms=compute_ms, tokens_in=tokens_in, tokens_out=tokens_out))
        return reply

    def of_expiry(self, expired: Sequence[PendingRequest], now_ms: float) -> Reply:
        answers = self._answers
        reply = Reply()
        stamp = int(now_ms)
        timing = BatchTiming(stamp, stamp, stamp, stamp, 0, "none")
        for pr in expired:
            held: Held = pr.payload
            verdict = Verdict("expired", pr.expiry or DEADLINE)
            reply.messages.append(answers.answered(held, verdict, stamp, error=expiry_text(pr)))
            reply.messages.append(
                answers.latency(
                    held, verdict, timing, batch_id=-1, batch_size=0, marked=pr.marked, priority=pr.priority
                )
            )
            reply.answered.append(held)
            self._stats.answered["expired"] += 1
        return reply

    def of_refusals(self, rejected: Sequence[tuple[ConsumerRecord, Rejection]], fetch_ms: int, done_ms: int) -> Reply:
        """A dead letter for each refused record, a `rejected` answer when it has an id, and a
        `rejected` latency event with the reason, so refusals count wherever outcomes do (a record
        without an id under its place in the topic). Duplicates get neither answer nor event: the
        first answer stands, and its request is counted once."""
        answers, stats = self._answers, self._stats
        reply = Reply()
        messages = reply.messages
        for record, rejection in rejected:
            tp = TopicPartition(record.topic, record.partition)
            messages.append(
                answers.dead_letter(
                    rejection.reason,
                    rejection.detail,
                    source=tp,
                    offset=record.offset,
                    timestamp_ms=record.timestamp,
                    original=record.value or b"",
                    request_id=rejection.request_id,
                )
            )
            stats.dead_letters += 1
            reply.offsets.append((tp, record.offset))
            if rejection.reason == "duplicate":
                continue
            verdict = Verdict("rejected", rejection.reason)
            if rejection.request_id is not None:
                messages.append(
                    answers.result(
                        rejection.request_id,
                        rejection.reply_topic,
                        "rejected",
                        enqueue_ms=record.timestamp,
                        done_ms=done_ms,
                        error=f"{rejection.reason}: {rejection.detail}",
                        verdict=verdict,
                    )
                )
                stats.answered["rejected"] += 1
            messages.append(
                answers.refused(
                    rejection.reason,
                    request_id=rejection.request_id,
                    source=tp,
                    offset=record.offset,
                    timestamp_ms=record.timestamp,
                    fetch_ms=fetch_ms,
                    done_ms=done_ms,
                    warmup=rejection.warmup,
                    trace_index=rejection.trace_index,
                    verdict=verdict,
                )
            )
        return reply
