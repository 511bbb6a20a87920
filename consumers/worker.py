"""The GPU consumer: the aiokafka loop that drives one model's batching engine.

Data flow, in the order a request meets it:

1. `_fetch_loop` pulls records (priority partitions first), decodes each with
   `consumers.intake`, dead-letters the bad ones and offers the rest to the
   engine with the record's CreateTime as enqueue time. Past
   `ConsumerSettings.max_queue` pending requests it pauses its partitions
   (backpressure: memory stays bounded while the backlog waits in Kafka).
2. `_drive` asks the engine what to do. It runs on every arrival, every
   completion and at the engine's `wake_at_ms`, never on a fixed tick.
3. `_run_batch` runs the batch in a worker thread (`run_isolating`, so one
   poison request fails alone) while fetching goes on, then publishes the
   results, one LatencyEvent per request and one BatchEvent per batch.
4. Offsets are committed only up to the first unanswered record of each
   partition (`consumers.offsets`), after the answers are acknowledged by the
   broker: at-least-once, or exactly-once inside a Kafka transaction when
   `KafkaSettings.transactional` is set.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError

from consumers.events import BatchTiming, Held, batch_event, latency_event
from consumers.forwarding import forward_headers, tails_to_forward
from consumers.heap import freeze_heap
from consumers.intake import Rejection, RecentIds, decode_request, parse_forward_headers
from consumers.kafka import Topics, client_options
from consumers.offsets import OffsetTracker
from consumers.outbox import Message, Outbox
from consumers.runners import profile_file, serving_runner
from consumers.runners.base import Output, Runner, run_isolating
from pipeline.config import Config, ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.engine.decisions import Batch, PendingRequest
from pipeline.engine.engine import BatchingEngine
from schemas.messages import DeadLetter, Outcome, Request, Result

log = logging.getLogger("batchtide.consumer")

_encode = msgspec.json.Encoder().encode
FORWARD_SCAN_INTERVAL_MS = 20.0
"""Looking for tails to forward scans the local queue; at most this often."""
REPLY_TOPIC_CHECK_S = 2.0
"""How long to wait for metadata of a request's reply topic before falling back."""
REPLY_TOPIC_RECHECK_S = 60.0
"""A reply topic found missing is not asked about again for this long."""
RESUME_FRACTION = 0.75
"""Paused partitions resume once the queue is back under this share of max_queue."""
WARM_UP_TEXT = "warm up the device before the group hands this consumer its partitions"
WARM_UP_MAX_BATCH = 64
WARM_UP_BUDGET_S = 2.0
"""Warm-up doubles the batch size up to the profile's target (at most 64 requests) while
the next batch is expected to fit in this budget."""


def now_ms() -> float:
    """Wall-clock epoch ms: the engine compares it with Kafka CreateTime."""
    return time.time() * 1000.0


def default_consumer_id(model: str) -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{model}"


def build_consumer(
    config: Config, model_name: str, *, consumer_id: str | None = None, runner: Runner | None = None
) -> "Consumer":
    """A consumer for one configured model with its runner and its own engine (started from the
    model's profile file when `batchtide profile` wrote one: measured curve, device limit)."""
    model, measured = profile_file.apply(config.model(model_name))
    engine = BatchingEngine(model.profile)
    profile_file.seed(engine.curve, measured)
    return Consumer(
        model,
        config.kafka,
        config.consumer,
        runner=runner or serving_runner(model),
        engine=engine,
        consumer_id=consumer_id,
    )


@dataclass
class ConsumerStats:
    """Counters a test or the CLI can read while the consumer runs."""

    fetched: int = 0
    answered: dict[str, int] = field(default_factory=lambda: {"ok": 0, "expired": 0, "error": 0, "rejected": 0})
    dead_letters: int = 0
    batches: int = 0
    forwarded: int = 0
    queue: int = 0
    """Requests held in the engine right now."""
    max_queue_seen: int = 0
    """Highest `queue` ever observed; never above ConsumerSettings.max_queue."""
    pauses: int = 0
    commits: int = 0
    backlog: int = 0
    """Kafka lag of the assigned partitions at the last fetch."""
    warm_up_sizes: list[int] = field(default_factory=list)
    """Batch sizes run before joining the group."""


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, consumer: "Consumer") -> None:
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._consumer._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self._consumer._on_assigned(set(assigned))


class Consumer:
    """One model's consumer in one process: fetch, batch, run, answer, commit."""

    def __init__(
        self,
        model: ModelConfig,
        kafka: KafkaSettings,
        settings: ConsumerSettings,
        *,
        runner: Runner,
        engine: BatchingEngine,
        consumer_id: str | None = None,
    ) -> None:
        self.model = model
        self.kafka = kafka
        self.settings = settings
        self.runner = runner
        self.engine = engine
        self.consumer_id = consumer_id or default_consumer_id(model.name)
        self.topics = Topics(kafka.topic_prefix)
        self.request_topic = self.topics.requests(model.name)
        self.priority_topic = self.topics.priority(model.name)
        self.group_id = Topics(kafka.topic_prefix).group(model.name)
        self.stats = ConsumerStats()
        self._profile = model.profile
        self._tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._answered_ids = RecentIds()
        self._waiting: dict[tuple[TopicPartition, int], PendingRequest] = {}
        """Requests offered to the engine and not yet dispatched, expired or forwarded."""
        self._waiting_ids: set[str] = set()
        self._running_ids: set[str] = set()
        """Ids of dispatched requests until their answers are published (then `_answered_ids` knows them)."""
        self._inflight: set[asyncio.Task[None]] = set()
        self._computing = 0
        """Batches on the device now (the inflight tasks may still be publishing)."""
        self._publishing: set[asyncio.Task[None]] = set()
        self._paused = False
        """Request partitions are paused (backpressure)."""
        self._room = asyncio.Event()
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at: float | None = None
        self._last_forward_scan = 0.0
        self._next_batch_cap = model.profile.hard_cap
        self._stopping = False
        self._failure: BaseException | None = None
        self._txn_lock = asyncio.Lock()
        self._own_topics = {
            self.topics.results(model.name),
            self.priority_topic,
            *self.topics.shared,
        }
        self._reply_topics: dict[str, tuple[bool, float]] = {}
        """Reply topic -> (exists, when checked): answers to a missing one go to the results topic."""
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._outbox: Outbox | None = None
        self._device = ThreadPoolExecutor(model.profile.max_inflight_batches, thread_name_prefix="batchtide-device")
        """Batches run here, one thread per in-flight batch, so fetching goes on meanwhile."""

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Load and warm the runner, then join the group (a member that joins before its
        model is ready holds partitions it cannot serve)."""
        options = client_options(self.kafka)
        await asyncio.get_running_loop().run_in_executor(self._device, self._warm_up)
        producer_options: dict[str, Any] = dict(linger_ms=0, max_batch_size=256 * 1024)
        if self.kafka.transactional:
            producer_options["transactional_id"] = f"{self.group_id}.{self.consumer_id}"
        self._producer = AIOKafkaProducer(**options, **producer_options)
        await self._producer.start()
        self._outbox = Outbox(self._producer, set(self.topics.shared))
        self._outbox.start()
        self._consumer = AIOKafkaConsumer(
            **options,
            group_id=self.group_id,
            client_id=self.consumer_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed" if self.kafka.transactional else "read_uncommitted",
            max_partition_fetch_bytes=1024 * 1024,
        )
        await self._consumer.start()
        self._consumer.subscribe([self.request_topic, self.priority_topic], listener=_Rebalance(self))

    def _warm_up(self) -> None:
        """Load the model and run throwaway batches of doubling size (a real model's first
        batch at a new size is several times slower: allocator growth, page faults, kernel
        choice), so neither the first live burst nor the engine's t(b) pays for it."""
        self.runner.load()
        top = 1 if self.runner.simulated else min(self._profile.target_size, WARM_UP_MAX_BATCH)
        size, spent_s, last_s = 1, 0.0, 0.0
        while size <= top and spent_s + 2 * last_s <= WARM_UP_BUDGET_S:
            probes = [
                Request(id=f"batchtide-warm-up-{size}-{i}", model=self.model.name, text=WARM_UP_TEXT)
                for i in range(size)
            ]
            if self.runner.check(probes[0]) is not None:
                return
            start = time.monotonic()
            run_isolating(self.runner, probes)
            last_s = time.monotonic() - start
            spent_s += last_s
            self.stats.warm_up_sizes.append(size)
            size *= 2

    async def run(self, stop: asyncio.Event, drain_timeout_s: float = 30.0) -> None:
        """Serve until `stop` is set, then stop fetching, finish what is held, commit, close."""
        fetch = asyncio.create_task(self._fetch_loop(stop), name="fetch")
        commit = None if self.kafka.transactional else asyncio.create_task(self._commit_loop(), name="commit")
        try:
            await fetch
            await self._drain(drain_timeout_s)
        finally:
            if commit is not None:
                commit.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await commit
            await self._close()
        if self._failure is not None:
            raise self._failure

    async def _drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (self.engine.pending or self._inflight or self._publishing) and time.monotonic() < deadline:
            if self._failure is not None:
                return
            self._drive()
            await asyncio.sleep(0.005)
        await self._settle()
        await self._commit()

    async def _close(self) -> None:
        if self._wake is not None:
            self._wake.cancel()
        if self._consumer is not None:
            await self._consumer.stop()
        if self._outbox is not None:
            await self._outbox.stop()
        if self._producer is not None:
            await self._producer.stop()
        self._device.shutdown(wait=False)

    def _fail(self, error: BaseException) -> None:
        """A publish the broker refused: stop without committing past it (it is redelivered)."""
        if self._failure is None:
            log.error("consumer %s stopping after error: %r", self.consumer_id, error)
            self._failure = error
        self._stopping = True
        self._room.set()

    # ---- fetching ----------------------------------------------------------

    async def _fetch_loop(self, stop: asyncio.Event) -> None:
        consumer = self._consumer
        assert consumer is not None
        limit = self.settings.max_queue
        while not stop.is_set() and not self._stopping:
            queued = self.engine.pending
            self._flow(consumer, queued)
            room = limit - queued
            if room <= 0:
                self._room.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._room.wait(), 0.5)
                continue
            records = await self._fetch(consumer, min(self.settings.fetch_max_records, room))
            if records:
                self._intake(records)
            self._update_backlog(consumer)
            self._drive()

    async def _fetch(self, consumer: AIOKafkaConsumer, want: int) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Priority partitions first: whatever is buffered there is taken before the rest."""
        priority = [tp for tp in consumer.assignment() if tp.topic == self.priority_topic]
        if priority:
            got = await consumer.getmany(*priority, timeout_ms=0, max_records=want)
            if got:
                return got
        # paused: come back soon to resume as the queue drains (a paused fetch returns nothing)
        return await consumer.getmany(timeout_ms=10 if self._paused else 100, max_records=want)

    def _flow(self, consumer: AIOKafkaConsumer, queued: int) -> None:
        """Backpressure: pause request partitions when the queue is nearly full, priority ones only when full.

        The reserve keeps room for forwarded tails and urgent requests while
        the ordinary backlog waits in Kafka; `getmany(max_records=room)` makes
        the bound exact.
        """
        limit = self.settings.max_queue
        if queued >= limit - max(1, limit // 8):
            if not self._paused:
                self.stats.pauses += 1
            self._paused = True
        elif self._paused and queued <= limit * RESUME_FRACTION:
            self._paused = False
        priority_full = queued >= limit
        paused = consumer.paused()
        for tp in consumer.assignment():
            want_paused = priority_full if tp.topic == self.priority_topic else self._paused
            if want_paused and tp not in paused:
                consumer.pause(tp)
            elif not want_paused and tp in paused:
                consumer.resume(tp)

    def _update_backlog(self, consumer: AIOKafkaConsumer) -> None:
        backlog = 0
        for tp in consumer.assignment():
            high = consumer.highwater(tp)
            if high is None:
                continue
            position = self._tracker.next_offset(tp)
            if position is not None:
                backlog += max(high - position, 0)
        self.stats.backlog = backlog

    def _intake(self, records: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        now = now_ms()
        fetch_ms = int(now)
        profile = self._profile
        tokens_cost = profile.cost_unit == "tokens"
        top_level = profile.priority_levels - 1
        rejected: list[tuple[ConsumerRecord, Rejection]] = []
        name = self.model.name
        max_bytes = self.settings.max_message_bytes
        for tp, batch in records.items():
            from_priority = tp.topic == self.priority_topic
            for record in batch:
                self.stats.fetched += 1
                self._tracker.received(tp, record.offset)
                decoded = decode_request(record.value, model=name, max_bytes=max_bytes)
                if isinstance(decoded, Rejection):
                    rejected.append((record, decoded))
                    continue
                refusal = self._refuse(decoded)
                if refusal is not None:
                    rejected.append((record, refusal))
                    continue
                forwarded_at = parse_forward_headers(record.headers) if from_priority else None
                enqueue = forwarded_at or (record.timestamp if record.timestamp > 0 else fetch_ms)
                tokens_in, tokens_out = self.runner.measure(decoded)
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
                    cost=tokens_in + tokens_out if tokens_cost else 1,
                    priority=0 if from_priority else min(decoded.priority, top_level),
                    deadline_ms=self._deadline(decoded, enqueue),
                    payload=held,
                )
                self._waiting[(tp, record.offset)] = pending
                self._waiting_ids.add(decoded.id)
                self.engine.offer(pending, now)
        queued = self.engine.pending
        self.stats.queue = queued
        if queued > self.stats.max_queue_seen:
            self.stats.max_queue_seen = queued
        if rejected:
            self._dead_letter(rejected)

    def _refuse(self, request: Request) -> Rejection | None:
        duplicate = self._answered_ids.check(request)
        if duplicate is not None:
            return duplicate
        if request.id in self._waiting_ids or request.id in self._running_ids:
            return Rejection(
                "duplicate",
                f"request id {request.id[:40]!r} is already waiting or running in this consumer",
                request.id,
                request.reply_topic,
            )
        why = self.runner.check(request)
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

    # ---- deciding ---------------------------------------------------------

    def _drive(self) -> None:
        """Ask the engine what to do now; called on arrivals, completions and wake-ups."""
        if self._failure is not None:
            return
        engine = self.engine
        limit = self._profile.max_inflight_batches
        now = now_ms()
        wake_at = None
        for _ in range(limit + 1):
            decision = engine.poll(now, device_free=self._computing < limit, backlog=self.stats.backlog)
            if decision.expired:
                self._expire(decision.expired, now)
            wake_at = decision.wake_at_ms
            if decision.batch is None:
                break
            self._dispatch(decision.batch, now)
        self._set_wake(wake_at)
        if self.settings.tail_forwarding and now - self._last_forward_scan >= FORWARD_SCAN_INTERVAL_MS:
            self._last_forward_scan = now
            self._forward_tails()
        queued = engine.pending
        self.stats.queue = queued
        if queued < self.settings.max_queue:
            self._room.set()

    def _set_wake(self, wake_at: float | None) -> None:
        if wake_at == self._wake_at:
            return
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        self._wake_at = wake_at
        if wake_at is not None:
            delay = max(0.0, (wake_at - now_ms()) / 1000.0)
            self._wake = asyncio.get_running_loop().call_later(delay, self._on_wake)

    def _on_wake(self) -> None:
        self._wake = None
        self._wake_at = None
        self._drive()

    def _dispatch(self, batch: Batch, now: float) -> None:
        self._next_batch_cap = batch.record.effective_cap
        for pr in batch.requests:
            self._unwait(pr.payload)
            self._running_ids.add(pr.payload.request.id)
        self.stats.batches += 1
        self._computing += 1
        self._track(self._inflight, self._run_batch(batch, now))

    def _unwait(self, held: Held) -> None:
        if self._waiting.pop((held.tp, held.offset), None) is not None:
            self._waiting_ids.discard(held.request.id)

    def _track(self, tasks: set[asyncio.Task[None]], coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        task.add_done_callback(self._check_task)

    def _check_task(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())  # type: ignore[arg-type]

    # ---- running and answering --------------------------------------------

    async def _run_batch(self, batch: Batch, dispatch_ms: float) -> None:
        reqs = [pr.payload.request for pr in batch.requests]
        start = now_ms()
        try:
            loop = asyncio.get_running_loop()
            outputs, failures, memory = await loop.run_in_executor(self._device, self._compute, reqs)
        finally:
            self._computing -= 1
        end = now_ms()
        self.engine.completed(batch, end, end - start)
        self._drive()
        timing = BatchTiming(int(dispatch_ms), int(start), int(end), 0, memory[0], memory[1])
        messages: list[Message] = []
        answered: list[Held] = []
        tokens_in = tokens_out = 0
        timing.produce_ms = int(now_ms())
        for index, pr in enumerate(batch.requests):
            held: Held = pr.payload
            output = outputs.get(index)
            if output is None:
                error = failures.get(index, "runner returned no output")
                messages.append(self._dead_letter_message(held, "runner_error", error))
                self.stats.dead_letters += 1
                result = self._result(held, "error", batch.batch_id, timing.produce_ms, error=error)
                outcome: Outcome = "error"
            else:
                held.tokens_out = output.tokens_out
                tokens_in += held.tokens_in
                tokens_out += output.tokens_out
                result = self._result(held, "ok", batch.batch_id, timing.produce_ms, output=output)
                outcome = "ok"
            messages.append(self._result_message(held, result))
            messages.append(self._latency_message(held, outcome, timing, batch.batch_id, batch.size, pr))
            answered.append(held)
            self.stats.answered[outcome] += 1
        event = batch_event(
            batch,
            model=self.model.name,
            consumer_id=self.consumer_id,
            target_size=self._profile.target_size,
            compute_ms=end - start,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            timing=timing,
        )
        messages.append((self.topics.batch_events, None, _encode(event), None))
        try:
            await self._publish(messages, answered)
        finally:
            self._running_ids.difference_update(pr.payload.request.id for pr in batch.requests)

    def _compute(self, reqs: list[Request]) -> tuple[dict[int, Output], dict[int, str], tuple[int, str]]:
        outputs, failures = run_isolating(self.runner, reqs)
        return outputs, failures, self.runner.device_memory()

    def _result(
        self,
        held: Held,
        outcome: Outcome,
        batch_id: int | None,
        done_ms: int,
        *,
        output: Output | None = None,
        error: str | None = None,
    ) -> Result:
        return Result(
            id=held.request.id,
            model=self.model.name,
            outcome=outcome,
            embedding=output.embedding if output else None,
            text=output.text if output else None,
            token_ids=output.token_ids if output else None,
            error=error,
            batch_id=batch_id,
            consumer_id=self.consumer_id,
            enqueue_ms=held.enqueue_ms,
            done_ms=done_ms,
        )

    def _result_message(self, held: Held, result: Result) -> Message:
        topic = held.request.reply_topic or self.topics.results(self.model.name)
        return (topic, held.request.id.encode(), _encode(result), None)

    def _latency_message(
        self, held: Held, outcome: Outcome, timing: BatchTiming, batch_id: int, size: int, pr: PendingRequest
    ) -> Message:
        event = latency_event(
            held,
            model=self.model.name,
            consumer_id=self.consumer_id,
            outcome=outcome,
            timing=timing,
            batch_id=batch_id,
            batch_size=size,
            marked=pr.marked,
            priority=pr.priority,
        )
        return (self.topics.latency_events, held.request.id.encode(), _encode(event), None)

    def _expire(self, expired: list[PendingRequest], now: float) -> None:
        messages: list[Message] = []
        answered: list[Held] = []
        stamp = int(now)
        timing = BatchTiming(stamp, stamp, stamp, stamp, 0, "none")
        for pr in expired:
            held: Held = pr.payload
            self._unwait(held)
            result = self._result(held, "expired", None, stamp, error="deadline passed before the request could run")
            messages.append(self._result_message(held, result))
            messages.append(self._latency_message(held, "expired", timing, -1, 0, pr))
            answered.append(held)
            self.stats.answered["expired"] += 1
        if messages:
            self._track(self._publishing, self._publish(messages, answered))

    def _dead_letter(self, rejected: list[tuple[ConsumerRecord, Rejection]]) -> None:
        messages: list[Message] = []
        offsets: list[tuple[TopicPartition, int]] = []
        for record, rejection in rejected:
            tp = TopicPartition(record.topic, record.partition)
            letter = DeadLetter(
                reason=rejection.reason,
                detail=rejection.detail,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                timestamp_ms=record.timestamp,
                consumer_id=self.consumer_id,
                original_b64=base64.b64encode(record.value or b"").decode("ascii"),
                request_id=rejection.request_id,
            )
            key = rejection.request_id.encode() if rejection.request_id else None
            messages.append((self.topics.dlq, key, _encode(letter), None))
            self.stats.dead_letters += 1
            if rejection.request_id is not None and rejection.reason != "duplicate":
                result = Result(
                    id=rejection.request_id,
                    model=self.model.name,
                    outcome="rejected",
                    error=f"{rejection.reason}: {rejection.detail}",
                    consumer_id=self.consumer_id,
                    enqueue_ms=record.timestamp,
                    done_ms=int(now_ms()),
                )
                topic = rejection.reply_topic or self.topics.results(self.model.name)
                messages.append((topic, key, _encode(result), None))
                self.stats.answered["rejected"] += 1
            offsets.append((tp, record.offset))
        self._track(self._publishing, self._publish(messages, [], offsets))

    def _dead_letter_message(self, held: Held, reason: str, detail: str) -> Message:
        letter = DeadLetter(
            reason=reason,
            detail=detail,
            topic=held.tp.topic,
            partition=held.tp.partition,
            offset=held.offset,
            timestamp_ms=held.enqueue_ms,
            consumer_id=self.consumer_id,
            original_b64=base64.b64encode(held.raw).decode("ascii"),
            request_id=held.request.id,
        )
        return (self.topics.dlq, held.request.id.encode(), _encode(letter), None)

    # ---- tail forwarding ---------------------------------------------------

    def _forward_tails(self) -> None:
        cap = self._next_batch_cap
        if self.engine.pending <= cap or not self._others_share_priority():
            return
        chosen = tails_to_forward(self._waiting.values(), cap)
        if not chosen:
            return
        messages: list[Message] = []
        answered: list[Held] = []
        for pr in chosen:
            held: Held = pr.payload
            self.engine.withdraw(pr)
            self._unwait(held)
            messages.append(
                (self.priority_topic, held.request.id.encode(), held.raw, forward_headers(held, self.consumer_id))
            )
            answered.append(held)
        self.stats.forwarded += len(chosen)
        self._track(self._publishing, self._publish(messages, answered, remember=False))

    def _others_share_priority(self) -> bool:
        """Forwarding helps only if another consumer owns part of the priority topic."""
        consumer = self._consumer
        assert consumer is not None
        partitions = consumer.partitions_for_topic(self.priority_topic) or set()
        owned = {tp.partition for tp in consumer.assignment() if tp.topic == self.priority_topic}
        return bool(partitions - owned)

    # ---- publishing and committing -------------------------------------------

    async def _publish(
        self,
        messages: list[Message],
        answered: list[Held],
        offsets: list[tuple[TopicPartition, int]] = (),  # type: ignore[assignment]
        *,
        remember: bool = True,
    ) -> None:
        """Produce `messages`; once the broker has them, their requests count as answered."""
        outbox = self._outbox
        assert outbox is not None
        done = [(h.tp, h.offset) for h in answered] + list(offsets)
        messages = await self._routed(messages)
        if self.kafka.transactional:
            await self._publish_transaction(outbox, messages, done)
        else:
            await outbox.publish(messages)
            for tp, offset in done:
                self._tracker.answered(tp, offset)
        if remember:
            for held in answered:
                self._answered_ids.add(held.request.id)

    async def _routed(self, messages: list[Message]) -> list[Message]:
        """Send answers for a reply topic that does not exist to the model's results topic instead.

        A client's typo in `reply_topic` must not stall or stop the consumer
        (producing to a missing topic blocks for the request timeout, then fails).
        """
        if all(m[0] in self._own_topics for m in messages):
            return messages
        fallback = self.topics.results(self.model.name)
        routed: list[Message] = []
        for topic, key, value, headers in messages:
            if topic not in self._own_topics and not await self._reply_topic_exists(topic):
                topic = fallback
            routed.append((topic, key, value, headers))
        return routed

    async def _reply_topic_exists(self, topic: str) -> bool:
        known = self._reply_topics.get(topic)
        now = time.monotonic()
        if known is not None and (known[0] or now - known[1] < REPLY_TOPIC_RECHECK_S):
            return known[0]
        producer = self._producer
        assert producer is not None
        try:
            exists = bool(await asyncio.wait_for(producer.partitions_for(topic), REPLY_TOPIC_CHECK_S))
        except (asyncio.TimeoutError, KafkaError):
            exists = False
        if not exists:
            log.warning("reply topic %r does not exist; its answers go to %s", topic, self.topics.results(self.model.name))
        self._reply_topics[topic] = (exists, now)
        return exists

    async def _publish_transaction(
        self, outbox: Outbox, messages: list[Message], done: list[tuple[TopicPartition, int]]
    ) -> None:
        """Answers and the offsets they free in one transaction: exactly-once results."""
        producer = self._producer
        assert producer is not None
        async with self._txn_lock:
            async with producer.transaction():
                await outbox.send_all(messages)
                for tp, offset in done:
                    self._tracker.answered(tp, offset)
                offsets = self._owned(self._tracker.to_commit())
                if offsets:
                    await producer.send_offsets_to_transaction(offsets, self.group_id)
            self._tracker.committed(offsets)
            self.stats.commits += 1 if offsets else 0

    def _owned(self, offsets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        consumer = self._consumer
        assigned = consumer.assignment() if consumer is not None else set()
        return {tp: offset for tp, offset in offsets.items() if tp in assigned}

    async def _commit_loop(self) -> None:
        interval = self.settings.commit_interval_ms / 1000.0
        while True:
            await asyncio.sleep(interval)
            await self._commit()

    async def _commit(self, partitions: set[TopicPartition] | None = None) -> None:
        consumer = self._consumer
        if consumer is None or self._failure is not None:
            return
        if self.kafka.transactional:
            await self._commit_transaction(partitions)
            return
        offsets = self._owned(self._tracker.to_commit(partitions))
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as e:
            log.warning("commit of %s failed (%r); the next owner re-reads from the last commit", offsets, e)
            return
        self._tracker.committed(offsets)
        self.stats.commits += 1

    async def _commit_transaction(self, partitions: set[TopicPartition] | None) -> None:
        producer = self._producer
        assert producer is not None
        async with self._txn_lock:
            offsets = self._owned(self._tracker.to_commit(partitions))
            if not offsets:
                return
            async with producer.transaction():
                await producer.send_offsets_to_transaction(offsets, self.group_id)
            self._tracker.committed(offsets)

    async def _settle(self, timeout_s: float = 30.0) -> None:
        """Wait for running batches and pending publishes to finish."""
        deadline = time.monotonic() + timeout_s
        while (self._inflight or self._publishing) and time.monotonic() < deadline:
            await asyncio.wait(self._inflight | self._publishing, timeout=max(0.0, deadline - time.monotonic()))

    # ---- rebalancing -----------------------------------------------------------

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Finish in-flight work, commit what it answered, abandon the rest uncommitted."""
        if not revoked:
            return
        for key in [k for k in self._waiting if k[0] in revoked]:
            pending = self._waiting[key]
            self.engine.withdraw(pending)
            self._unwait(pending.payload)
        await self._settle()
        await self._commit(revoked)
        self._tracker.forget(revoked)
        log.info("consumer %s: revoked %d partitions", self.consumer_id, len(revoked))

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        log.info("consumer %s: assigned %s", self.consumer_id, sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))


async def serve(
    config: Config,
    model_name: str,
    stop: asyncio.Event,
    *,
    consumer_id: str | None = None,
    create_topics: bool = True,
    on_stats: Callable[[Consumer], None] | None = None,
    stats_interval_s: float = 10.0,
) -> Consumer:
    """Run one consumer until `stop` is set; returns it (its stats) after a clean shutdown."""
    from consumers.kafka import ensure_topics

    consumer = build_consumer(config, model_name, consumer_id=consumer_id)
    reporter = None
    try:
        if create_topics:
            await ensure_topics(config.kafka, {model_name: consumer.model.partitions})
        await consumer.start()
        freeze_heap()  # this process is the consumer's: what it loaded stays for its lifetime
        if on_stats is not None:
            report = on_stats

            async def every_interval() -> None:
                while True:
                    await asyncio.sleep(stats_interval_s)
                    report(consumer)

            reporter = asyncio.create_task(every_interval())
        await consumer.run(stop)
    finally:
        if reporter is not None:
            reporter.cancel()
        await asyncio.to_thread(consumer.runner.close)
    return consumer
