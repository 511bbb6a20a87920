"""Admission: one fetched record becomes a `PendingRequest` for the engine, or a `Rejection`.

The first steps of a record's path, in order: decode and validate
(`consumers.intake.decode_request`, which refuses an oversize record from
its length before decoding), the reply-topic rules, duplicate ids, the
runner's own check (token limits), then the enqueue time (the record's
CreateTime, or the original one a tail forward carries) and the deadline.

Admission also remembers which request ids are waiting in the engine,
running on the device, or answered recently, because a duplicate is judged
against all three.
"""

from __future__ import annotations

import dataclasses

from aiokafka import ConsumerRecord, TopicPartition

from consumers.answers import Held
from consumers.intake import (
    RecentIds,
    Rejection,
    check_reply_topic,
    decode_request,
    parse_forward_headers,
    reply_topic_problem,
)
from consumers.runners.base import Runner
from pipeline.core.config import ModelConfig
from pipeline.core.engine.decisions import BatchPolicy, PendingRequest
from pipeline.core.kafka.client import Topics
from pipeline.core.kafka.offsets import OffsetTracker
from schemas.messages import Request


class Admission:
    """Decode, check, dedup and date records for one model's engine."""

    def __init__(self, model: ModelConfig, runner: Runner, topics: Topics, max_message_bytes: int) -> None:
        self._model = model.name
        self._profile = model.profile
        self._runner = runner
        self._max_bytes = max_message_bytes
        self._prefix = topics.prefix
        self._results_topic = topics.results(model.name)
        self._priority_topic = topics.priority(model.name)
        self.answered = RecentIds()
        self.waiting: dict[tuple[TopicPartition, int], PendingRequest] = {}
        """Requests offered to the engine and not yet dispatched, expired or forwarded."""
        self._waiting_ids: set[str] = set()
        self._running_ids: set[str] = set()
        """Ids of dispatched requests until their answers are published (then `answered` knows them)."""
        self.offered_cost = 0
        """Cost units of its own traffic (forwards in left out) offered to the engine so far: the
        group's balance reads its rate."""
        self.skipped_answered = 0
        """Records skipped because a previous owner of their partition answered them."""

    def intake(
        self,
        records: dict[TopicPartition, list[ConsumerRecord]],
        now_ms: float,
        tracker: OffsetTracker[TopicPartition],
        engine: BatchPolicy,
    ) -> list[tuple[ConsumerRecord, Rejection]]:
        """Admit one fetch: every record's offset is tracked (the commit must not pass it before it
        is answered), records a previous owner answered are skipped, admitted requests are offered
        to `engine`, refused records returned."""
        rejected: list[tuple[ConsumerRecord, Rejection]] = []
        for tp, batch in records.items():
            for record in batch:
                if not tracker.received(tp, record.offset):
                    self.skipped_answered += 1
                    continue
                admitted = self.admit(tp, record, int(now_ms))
                if isinstance(admitted, Rejection):
                    rejected.append((record, admitted))
                else:
                    engine.offer(admitted, now_ms)
                    if not admitted.payload.forwarded_in:
                        self.offered_cost += admitted.cost
        return rejected

    def admit(self, tp: TopicPartition, record: ConsumerRecord, fetch_ms: int) -> PendingRequest | Rejection:
        decoded = decode_request(record.value, model=self._model, max_bytes=self._max_bytes)
        if isinstance(decoded, Rejection):
            if reply_topic_problem(decoded.reply_topic, self._prefix, self._results_topic) is not None:
                return dataclasses.replace(decoded, reply_topic=None)  # refused or not, never answered there
            return decoded
        refusal = self._refuse(decoded)
        if refusal is not None:
            return dataclasses.replace(refusal, warmup=decoded.warmup, trace_index=decoded.trace_index)
        from_priority = tp.topic == self._priority_topic
        forwarded_at = parse_forward_headers(record.headers) if from_priority else None
        enqueue = forwarded_at or (record.timestamp if record.timestamp > 0 else fetch_ms)
        tokens_in, tokens_out = self._runner.measure(decoded)
        profile = self._profile
        held = Held(
            request=decoded,
            raw=record.value or b"",
            tp=tp,
            offset=record.offset,
            enqueue_ms=enqueue,
            fetch_ms=fetch_ms,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            forwarded_in=forwarded_at is not None,
        )
        pending = PendingRequest(
            request_id=decoded.id,
            enqueue_ms=float(enqueue),
            cost=tokens_in + tokens_out if profile.cost_unit == "tokens" else 1,
            priority=0 if from_priority else min(decoded.priority, profile.priority_levels - 1),
            deadline_ms=self._deadline(decoded, enqueue),
            payload=held,
        )
        self.waiting[(tp, record.offset)] = pending
        self._waiting_ids.add(decoded.id)
        return pending

    def _refuse(self, request: Request) -> Rejection | None:
        misdirected = check_reply_topic(request, self._prefix, self._results_topic)
        if misdirected is not None:
            return misdirected
        duplicate = self.answered.check(request)
        if duplicate is not None:
            return duplicate
        if request.id in self._waiting_ids or request.id in self._running_ids:
            return Rejection(
                "duplicate",
                f"request id {request.id[:40]!r} is already waiting or running in this consumer",
                request.id,
                request.reply_topic,
            )
        why = self._runner.check(request)
        if why is not None:
            return Rejection("input_too_long", why, request.id, request.reply_topic)
        return None

    def _deadline(self, request: Request, enqueue_ms: int) -> float | None:
        if request.deadline_ms is not None:
            return float(request.deadline_ms)
        if request.timeout_ms is not None:
            return float(enqueue_ms + request.timeout_ms)
        default = self._profile.default_deadline_ms
        return enqueue_ms + default if default is not None else None

    # ---- what happens to an admitted request afterwards --------------------------

    def unwait(self, held: Held) -> None:
        """It left the engine's queue (dispatched, expired, forwarded or withdrawn)."""
        if self.waiting.pop((held.tp, held.offset), None) is not None:
            self._waiting_ids.discard(held.request.id)

    def running(self, held: Held) -> None:
        self.unwait(held)
        self._running_ids.add(held.request.id)

    def published(self, request_ids: list[str], *, remember: bool) -> None:
        """Their answers (or forwards) are on the broker."""
        if remember:
            for request_id in request_ids:
                self.answered.add(request_id)

    def done_running(self, request_ids: list[str]) -> None:
        self._running_ids.difference_update(request_ids)

    def waiting_on(self, partitions: set[TopicPartition]) -> list[PendingRequest]:
        return [pending for (tp, _), pending in self.waiting.items() if tp in partitions]
