"""The GPU consumer's loop: fetch, drive one model's batching engine, run, hand answers on.

A record's path, and the module for each step:

1. fetch (`consumers.fetcher`, driven by `_fetch_loop` here): records from
   the priority partitions first. Past `ConsumerSettings.max_queue` pending
   requests the partitions are paused (backpressure: the backlog waits in
   Kafka, not in memory).
2. admit (`consumers.admit`): decode, check, dedup, date: a `PendingRequest`
   offered to the engine with the record's CreateTime, or a `Rejection`.
3. decide (here, `_drive`, asking `pipeline.engine`): on every arrival,
   completion and at the engine's `wake_at_ms`, never on a fixed tick.
4. run (here, `_run_batch`): in a device thread (`run_isolating`, so one
   poison request fails alone) while fetching goes on.
5. answer (`consumers.answers`): Result, DeadLetter, LatencyEvent and
   BatchEvent records, each knowing how to shrink or reroute itself.
6. publish and commit (`consumers.publish`, `consumers.delivery`): the
   records reach the broker in some form whatever it refuses, and only then
   do their offsets count as answered; commits stop at the first unanswered
   record of each partition (at-least-once), or go into the same Kafka
   transaction (exactly-once) when `KafkaSettings.transactional` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from consumers.admit import Admission
from consumers.answers import DEADLINE, RUNNER_ERROR, Answers, BatchTiming, Held, Verdict
from consumers.delivery import Delivery
from consumers.fetcher import Fetcher
from consumers.fleet import Fleet
from consumers.forwarding import forward_headers
from consumers.heap import freeze_heap
from consumers.intake import Rejection
from consumers.publish import Publisher
from pipeline.kafka.client import CLIENT_STOP_S, Topics, client_options, durable_producer, stop_client
from pipeline.kafka.offsets import OffsetTracker
from pipeline.kafka.outbox import BATCH_BYTES, Message, Outbox
from consumers.runners import serving_runner
from pipeline import profile_file
from consumers.runners.base import Output, Runner, run_isolating
from consumers.stats import ConsumerStats
from pipeline.kafka.topic_limits import TopicLimits
from pipeline.config import Config, ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.engine.decisions import Batch, PendingRequest
from pipeline.engine.engine import BatchingEngine
from pipeline.engine.fleet import (
    ForwardRule,
    beacon_view,
    curve_view,
    dispatch_order,
    peers_after,
    plan_forwards,
    recent_batch_ms,
)
from schemas.messages import FleetBeacon, Request

log = logging.getLogger("batchtide.consumer")

STOP_WORK_SHARE = 0.8
"""Share of `stop_timeout_s` for finishing held work; committing and closing get the rest."""
FORWARD_SCAN_INTERVAL_MS = 20.0
"""Looking for requests a peer would finish sooner scans the local queue; at most this often."""
WARM_UP_TEXT = "warm up the device before the group hands this consumer its partitions"
WARM_UP_MAX_BATCH = 64
WARM_UP_BUDGET_S = 2.0
"""Warm-up doubles the batch size up to the engine's ceiling (at most 64 requests) while
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
    model = config.model(model_name)
    engine = BatchingEngine(model.engine_profile(), **profile_file.apply(model))
    # the runner refuses what could never fit a batch, so it needs the cap as the engine resolved it
    # (hard_cap = "auto" becomes the device's limit)
    resolved = dataclasses.replace(model, profile=model.profile.replace(hard_cap=engine.ceiling))
    longest = profile_file.longest_request(model)
    if model.profile.cost_unit == "tokens" and engine.ceiling < longest:
        log.warning(
            "model %s: hard_cap %d tokens is under the longest request it admits (max_input_tokens %d + max_new_tokens "
            "%d = %d): longer requests are refused (input_too_long); raise hard_cap or lower max_input_tokens",
            model.name, engine.ceiling, model.max_input_tokens, model.max_new_tokens, longest,
        )
    return Consumer(
        model,
        config.kafka,
        config.consumer,
        runner=runner or serving_runner(resolved),
        engine=engine,
        consumer_id=consumer_id,
    )


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
        self._admission = Admission(model, runner, self.topics, settings.max_message_bytes)
        self._inflight: set[asyncio.Task[None]] = set()
        self._computing = 0
        """Batches on the device now (the inflight tasks may still be publishing)."""
        self._publishing: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._wake: asyncio.TimerHandle | None = None
        self._wake_at: float | None = None
        self._last_forward_scan = 0.0
        self._batch_ms = 0.0
        """Recent batch compute time (a moving average): what the group is told a forward costs here."""
        self._rule = ForwardRule(min_gain_ms=settings.forward_min_gain_ms, gain_share=settings.forward_gain_share)
        self._busy_until: dict[int, float] = {}
        """Expected end (wall-clock ms, from the learned t(b)) of each batch on the device."""
        self.fleet: Fleet | None = None
        self._stopping = False
        self._failure: BaseException | None = None
        self._own_topics = {
            self.topics.results(model.name),
            self.priority_topic,
            *self.topics.shared,
        }
        self._limits = TopicLimits(kafka)
        self._answers = Answers(model.name, self.consumer_id, self.topics, self._limits)
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._outbox: Outbox | None = None
        self._publisher: Publisher | None = None
        self._fetcher: Fetcher | None = None
        self._device = ThreadPoolExecutor(model.profile.max_inflight_batches, thread_name_prefix="batchtide-device")
        """Batches run here, one thread per in-flight batch, so fetching goes on meanwhile."""

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Load and warm the runner, then join the group (a member that joins before its
        model is ready holds partitions it cannot serve)."""
        options = client_options(self.kafka)
        await asyncio.get_running_loop().run_in_executor(self._device, self._warm_up)
        producer_options: dict[str, Any] = dict(
            linger_ms=0, max_batch_size=BATCH_BYTES, request_timeout_ms=self.kafka.request_timeout_ms, **durable_producer()
        )
        if self.kafka.transactional:
            producer_options["transactional_id"] = f"{self.group_id}.{self.consumer_id}"
        self._producer = AIOKafkaProducer(**options, **producer_options)
        await self._producer.start()
        self._outbox = Outbox(self._producer, set(self.topics.shared), self._limits)
        self._outbox.start()
        delivery = Delivery(
            self._producer, self._outbox, self._limits, self._own_topics, self.topics.results(self.model.name)
        )
        await self._limits.prefetch(sorted(self._own_topics))
        self._consumer = AIOKafkaConsumer(
            **options,
            group_id=self.group_id,
            client_id=self.consumer_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed" if self.kafka.transactional else "read_uncommitted",
            max_partition_fetch_bytes=1024 * 1024,
            request_timeout_ms=self.kafka.request_timeout_ms,
        )
        await self._consumer.start()
        self._publisher = Publisher(
            transactional=self.kafka.transactional,
            group_id=self.group_id,
            producer=self._producer,
            consumer=self._consumer,
            outbox=self._outbox,
            delivery=delivery,
            stats=self.stats,
        )
        self._fetcher = Fetcher(self._consumer, self.priority_topic, self.settings.max_queue, self.stats)
        self._consumer.subscribe([self.request_topic, self.priority_topic], listener=_Rebalance(self))
        if self.settings.fleet_beacon_ms > 0:
            self.fleet = Fleet(self.kafka, self.group_id, self.consumer_id, self.settings.fleet_beacon_ms, self.beacon)
            self.fleet.start()

    def _warm_up(self) -> None:
        """Load the model and run throwaway batches of doubling size (a real model's first
        batch at a new size is several times slower: allocator growth, page faults, kernel
        choice), so neither the first live burst nor the engine's t(b) pays for it."""
        self.runner.load()
        top = 1 if self.runner.simulated else min(self.engine.ceiling, WARM_UP_MAX_BATCH)
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

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then stop fetching, finish what is held, commit, close:
        all within `stop_timeout_s` (STOP_WORK_SHARE of it for the work), whatever the broker does."""
        fetch = asyncio.create_task(self._fetch_loop(stop), name="fetch")
        commit = None if self.kafka.transactional else asyncio.create_task(self._commit_loop(), name="commit")
        stop_by = None
        try:
            await fetch
            budget = self.settings.stop_timeout_s
            stop_by = time.monotonic() + budget
            await self._drain(stop_by - (1.0 - STOP_WORK_SHARE) * budget, stop_by)
        finally:
            if commit is not None:
                commit.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await commit
            await self._close(stop_by)
        if self._failure is not None:
            raise self._failure

    async def _drain(self, work_by: float, stop_by: float) -> None:
        while (self.engine.pending or self._inflight or self._publishing) and time.monotonic() < work_by:
            if self._failure is not None:
                return
            self._drive()
            await asyncio.sleep(0.005)
        await self._settle(max(0.0, work_by - time.monotonic()))
        try:
            await asyncio.wait_for(self._commit(), _share_of(stop_by, 3))
        except asyncio.TimeoutError:
            log.warning("consumer %s: the last commit did not finish; the group re-reads from the one before", self.consumer_id)

    async def _close(self, stop_by: float | None) -> None:
        """The Kafka clients share what is left of the stop budget (aiokafka can wait forever
        for a broker that is gone); CLIENT_STOP_S each when the consumer ends by an error."""
        if self._wake is not None:
            self._wake.cancel()
        if self.fleet is not None:
            await self.fleet.stop()
        if self._consumer is not None:
            await stop_client(self._consumer.stop, f"consumer {self.consumer_id}: the Kafka consumer", _share_of(stop_by, 2))
        abandoned = self._inflight | self._publishing
        if abandoned:
            # their offsets stay uncommitted: the group gets these records again
            log.warning("consumer %s: %d batches or answers unfinished at stop; left for redelivery",
                        self.consumer_id, len(abandoned))
            for task in abandoned:
                task.cancel()
            await asyncio.gather(*abandoned, return_exceptions=True)
        if self._outbox is not None:
            await self._outbox.stop()
        if self._producer is not None:
            await stop_client(self._producer.stop, f"consumer {self.consumer_id}: the Kafka producer", _share_of(stop_by, 1))
        self._device.shutdown(wait=False)

    def _fail(self, error: BaseException) -> None:
        """An error no record explains (a bug, or a transactional producer fenced by its successor):
        stop without committing past it, so what it held is redelivered."""
        if self._failure is None:
            log.error("consumer %s stopping after error: %r", self.consumer_id, error)
            self._failure = error
        self._stopping = True
        self._room.set()

    # ---- fetching ----------------------------------------------------------

    async def _fetch_loop(self, stop: asyncio.Event) -> None:
        fetcher = self._fetcher
        assert fetcher is not None
        limit = self.settings.max_queue
        while not stop.is_set() and not self._stopping:
            queued = self.engine.pending
            fetcher.flow(queued)
            room = limit - queued
            if room <= 0:
                self._room.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._room.wait(), 0.5)
                continue
            records = await fetcher.fetch(min(self.settings.fetch_max_records, room))
            if records:
                self._intake(records)
            self.stats.backlog = fetcher.backlog(self._tracker.next_offset)
            self._drive()

    def _intake(self, records: dict[TopicPartition, list[ConsumerRecord]]) -> None:
        now = now_ms()
        fetch_ms = int(now)
        tracker = self._tracker
        admission = self._admission
        rejected: list[tuple[ConsumerRecord, Rejection]] = []
        for tp, batch in records.items():
            for record in batch:
                self.stats.fetched += 1
                tracker.received(tp, record.offset)
                admitted = admission.admit(tp, record, fetch_ms)
                if isinstance(admitted, Rejection):
                    rejected.append((record, admitted))
                else:
                    self.engine.offer(admitted, now)
        queued = self.engine.pending
        self.stats.queue = queued
        if queued > self.stats.max_queue_seen:
            self.stats.max_queue_seen = queued
        if rejected:
            self._dead_letter(rejected, fetch_ms)

    @property
    def _tracker(self) -> OffsetTracker[TopicPartition]:
        publisher = self._publisher
        assert publisher is not None
        return publisher.tracker

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
            self._forward_to_peers(now)
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
        expected = self.engine.curve.estimate_ms(batch.record.cost)
        self._busy_until[batch.batch_id] = now + (expected or 0.0)
        for pr in batch.requests:
            self._admission.running(pr.payload)
        self.stats.batches += 1
        self._computing += 1
        self._track(self._inflight, self._run_batch(batch, now))

    def _unwait(self, held: Held) -> None:
        self._admission.unwait(held)

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
        reqs = [_with_deadline(pr) for pr in batch.requests]
        start = now_ms()
        try:
            loop = asyncio.get_running_loop()
            outputs, failures, memory = await loop.run_in_executor(self._device, self._compute, reqs)
        finally:
            self._computing -= 1
            self._busy_until.pop(batch.batch_id, None)
        end = now_ms()
        self.engine.completed(batch, end, end - start)
        self._batch_ms = recent_batch_ms(self._batch_ms, end - start, self._rule)
        self._drive()
        timing = BatchTiming(int(dispatch_ms), int(start), int(end), 0, memory[0], memory[1])
        answers = self._answers
        messages: list[Message] = []
        answered: list[Held] = []
        tokens_in = tokens_out = 0
        timing.produce_ms = done = int(now_ms())
        for index, pr in enumerate(batch.requests):
            held: Held = pr.payload
            output = outputs.get(index)
            if output is None:
                error = failures.get(index, "runner returned no output")
                messages.append(answers.dead_letter_of(held, RUNNER_ERROR, error))
                self.stats.dead_letters += 1
                verdict = Verdict("error", RUNNER_ERROR)
                messages.append(answers.answered(held, verdict, done, batch_id=batch.batch_id, error=error))
            else:
                held.tokens_out = output.tokens_out
                tokens_in += held.tokens_in
                tokens_out += output.tokens_out
                verdict = Verdict("expired", DEADLINE) if output.expired else Verdict("ok")
                error = f"deadline passed after {output.tokens_out} generated tokens (the text so far)" if output.expired else None
                messages.append(answers.answered(held, verdict, done, batch_id=batch.batch_id, output=output, error=error))
            messages.append(
                answers.latency(
                    held, verdict, timing, batch_id=batch.batch_id, batch_size=batch.size, marked=pr.marked,
                    priority=pr.priority, output=output,
                )
            )
            answered.append(held)
            self.stats.answered[verdict.outcome] += 1
        messages.append(answers.batch(batch, timing, compute_ms=end - start, tokens_in=tokens_in, tokens_out=tokens_out))
        try:
            await self._publish(messages, answered)
        finally:
            self._admission.done_running([pr.payload.request.id for pr in batch.requests])

    def _compute(self, reqs: list[Request]) -> tuple[dict[int, Output], dict[int, str], tuple[int, str]]:
        outputs, failures = run_isolating(self.runner, reqs)
        return outputs, failures, self.runner.device_memory()

    def _expire(self, expired: list[PendingRequest], now: float) -> None:
        answers = self._answers
        messages: list[Message] = []
        answered: list[Held] = []
        stamp = int(now)
        timing = BatchTiming(stamp, stamp, stamp, stamp, 0, "none")
        for pr in expired:
            held: Held = pr.payload
            self._unwait(held)
            verdict = Verdict("expired", DEADLINE)
            messages.append(answers.answered(held, verdict, stamp, error="deadline passed before the request could run"))
            messages.append(answers.latency(held, verdict, timing, batch_id=-1, batch_size=0, marked=pr.marked, priority=pr.priority))
            answered.append(held)
            self.stats.answered["expired"] += 1
        if messages:
            self._track(self._publishing, self._publish(messages, answered))

    def _dead_letter(self, rejected: list[tuple[ConsumerRecord, Rejection]], fetch_ms: int) -> None:
        """A dead letter for each refused record, a `rejected` answer when it has an id, and a
        `rejected` latency event with the reason, so refusals count wherever outcomes do (a record
        without an id under its place in the topic). Duplicates get neither answer nor event: the
        first answer stands, and its request is counted once."""
        answers = self._answers
        messages: list[Message] = []
        offsets: list[tuple[TopicPartition, int]] = []
        done = int(now_ms())
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
            self.stats.dead_letters += 1
            offsets.append((tp, record.offset))
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
                        done_ms=done,
                        error=f"{rejection.reason}: {rejection.detail}",
                        verdict=verdict,
                    )
                )
                self.stats.answered["rejected"] += 1
            messages.append(
                answers.refused(
                    rejection.reason, request_id=rejection.request_id, source=tp, offset=record.offset,
                    timestamp_ms=record.timestamp, fetch_ms=fetch_ms, done_ms=done, warmup=rejection.warmup,
                    verdict=verdict,
                )
            )
        self._track(self._publishing, self._publish(messages, [], offsets))

    # ---- balancing the group ---------------------------------------------

    def _busy_for(self, now: float) -> float:
        return max(0.0, max((end - now for end in self._busy_until.values()), default=0.0))

    def beacon(self) -> FleetBeacon:
        """What this consumer tells its group: how soon it could start one more request."""
        now = now_ms()
        consumer = self._consumer
        owned = consumer.assignment() if consumer is not None else set()
        view = beacon_view(
            self.consumer_id, now, self.engine.pending, curve_view(self.engine.curve, self._busy_for(now)),
            self._batch_ms, tuple(sorted(tp.partition for tp in owned if tp.topic == self.priority_topic)),
        )
        return FleetBeacon(
            member_id=view.member_id,
            model=self.model.name,
            group=self.group_id,
            at_ms=int(now),
            start_in_ms=view.start_in_ms,
            batch_ms=view.batch_ms,
            capacity_per_s=view.capacity_per_s,
            partitions=list(view.partitions),
        )

    def _forward_to_peers(self, now: float) -> None:
        """Hand the back of the queue to peers that would finish it clearly sooner
        (`pipeline.engine.fleet.plan_forwards`), each to a priority partition its peer owns."""
        fleet = self.fleet
        if fleet is None or self.engine.pending <= 1:
            return
        view = curve_view(self.engine.curve, self._busy_for(now))
        peers = fleet.peers()
        if view is None or not peers:
            return
        queue = dispatch_order(self._admission.waiting.values())
        rule = dataclasses.replace(self._rule, hop_ms=fleet.hop_ms)
        plan = plan_forwards(
            len(queue), [not pr.payload.forwarded_in for pr in queue], view, peers_after(self.consumer_id, peers),
            now, rule, fleet.sent,
        )
        room = self._limits.cached(self.priority_topic)
        messages: list[Message] = []
        answered: list[Held] = []
        for forward in plan:
            pr = queue[forward.index]
            held: Held = pr.payload
            message = Message(
                self.priority_topic, held.request.id.encode(), held.raw, forward_headers(held, self.consumer_id),
                partition=forward.partition,
            )
            if room is None or message.size > room:
                continue  # the priority topic would refuse it: it stays here
            self.engine.withdraw(pr)
            self._unwait(held)
            messages.append(message)
            answered.append(held)
        if not messages:
            return
        self.stats.forwarded += len(messages)
        self._track(self._publishing, self._publish(messages, answered, remember=False))

    # ---- publishing and committing -------------------------------------------

    async def _publish(
        self,
        messages: list[Message],
        answered: list[Held],
        offsets: list[tuple[TopicPartition, int]] = (),  # type: ignore[assignment]
        *,
        remember: bool = True,
    ) -> None:
        """Publish, then count the requests (and `offsets`) as answered."""
        publisher = self._publisher
        assert publisher is not None
        await publisher.publish(messages, [(h.tp, h.offset) for h in answered] + list(offsets))
        self._admission.published([h.request.id for h in answered], remember=remember)

    async def _commit_loop(self) -> None:
        interval = self.settings.commit_interval_ms / 1000.0
        while True:
            await asyncio.sleep(interval)
            await self._commit()

    async def _commit(self, partitions: set[TopicPartition] | None = None) -> None:
        if self._publisher is None or self._failure is not None:
            return
        await self._publisher.commit(partitions)

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
        for pending in self._admission.waiting_on(revoked):
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
    from consumers.lag import start_recorder
    from pipeline.kafka.client import ensure_topics

    consumer = build_consumer(config, model_name, consumer_id=consumer_id)
    reporter = lag = None
    try:
        if create_topics:
            await ensure_topics(config.kafka, {model_name: consumer.model.partitions})
        await consumer.start()
        freeze_heap()  # this process is the consumer's: what it loaded stays for its lifetime
        lag = start_recorder(consumer, config.kafka, config.consumer.lag_interval_ms)
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
        if lag is not None:
            await lag.stop()
        await asyncio.to_thread(consumer.runner.close)
    return consumer


def _share_of(stop_by: float | None, steps: int) -> float:
    """Seconds for the next of `steps` shutdown steps left before `stop_by` (at least 1 s)."""
    if stop_by is None:
        return CLIENT_STOP_S
    return max(1.0, (stop_by - time.monotonic()) / steps)


def _with_deadline(pr: PendingRequest) -> Request:
    """The request as the runner sees it: with the deadline the engine holds (from timeout_ms or
    the profile's default) in absolute form, so generation can stop a row when it passes."""
    request: Request = pr.payload.request
    if pr.deadline_ms is None or request.deadline_ms is not None:
        return request
    return msgspec.structs.replace(request, deadline_ms=int(pr.deadline_ms))
