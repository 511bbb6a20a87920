"""The GPU consumer's loop: fetch, admit, drive one model's batching engine, dispatch.

A record's path, and the module for each step (this file ties them together):

  fetch    consumers/fetcher.py     priority partitions first; paused past max_queue
           (share mode: consumers/sharing.py, members of a share group that pull while the device is free)
  admit    consumers/admit.py       decode, check, dedup, date (the checks: intake.py)
  decide   consumers/decide.py      asks pipeline/core/engine (its `ServingPolicy` protocol) on
                                    every arrival, completion and wake-up (clock.py `Alarm`)
  forward  consumers/forwarding.py  the back of the queue to a faster peer (beacons: fleet.py)
  run      consumers/device.py      a device thread per batch; a poison request fails alone
  answer   consumers/outcomes.py    which records a finished batch, an expiry or a refusal
                                    gets (answers.py builds each record)
  publish  consumers/publish.py     on the broker in some form (delivery.py), then answered
  commit   consumers/membership.py  up to each partition's first unanswered record;
                                    rebalances (or in the batch's transaction: publish.py, fencing.py;
                                    share mode: each record acknowledged, consumers/sharing.py)

Around the path: Kafka clients (clients.py), batches and publishes in flight
(tasks.py), warm-up (warm_up.py), the stop budget (stop_budget.py), time
(clock.py), one process (serving.py), counters (stats.py), lag (lag.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
from collections.abc import Callable, Sequence

from aiokafka import ConsumerRecord, TopicPartition

from consumers.admit import Admission
from consumers.answers import Answers, BatchTiming
from consumers.clients import ClientPlan, KafkaClients, ShareClients, open_clients, open_share_clients
from consumers.clock import Alarm, Clock, SystemClock
from consumers.decide import poll_engine
from consumers.device import Device
from consumers.forwarding import PeerForwarding
from consumers.membership import Membership
from consumers.outcomes import Outcomes, Reply
from consumers.runners import serving_runner
from consumers.runners.base import Runner
from consumers.sharing import check_lock, describe_lock, enforce_lock
from consumers.stats import ConsumerStats
from consumers.stop_budget import StopBudget, step_s
from consumers.tasks import Work
from pipeline.core import profile_file
from pipeline.core.config import Config, ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.core.engine.decisions import Batch, ServingPolicy
from pipeline.core.engine.engine import BatchingEngine
from pipeline.core.engine.peer_forwarding import capacity_per_s
from pipeline.core.engine.share_pull import PullRule, outpaces_a_peer, pull_bound
from pipeline.core.kafka.client import Topics
from pipeline.core.kafka.offsets import OffsetTracker
from pipeline.core.kafka.share_client import prepare_share_group
from pipeline.core.kafka.topic_limits import TopicLimits
from schemas.messages import FleetBeacon

log = logging.getLogger("batchtide.consumer")


def default_consumer_id(model: str) -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{model}"


def build_consumer(
    config: Config, model_name: str, *, consumer_id: str | None = None, runner: Runner | None = None
) -> Consumer:
    """A consumer for one configured model with its runner and its own engine (started from the
    model's profile file when `batchtide profile` wrote one: measured curve, device limit)."""
    model = config.model(model_name)
    measured = profile_file.apply(model)
    engine = BatchingEngine(model.engine_profile(), **measured)
    # the runner refuses what could never fit a batch, so it needs the cap as the engine resolved it
    # (hard_cap = "auto" becomes the device's limit)
    resolved = dataclasses.replace(model, profile=model.profile.replace(hard_cap=engine.ceiling))
    longest = profile_file.longest_request(model)
    if model.profile.cost_unit == "tokens" and engine.ceiling < longest:
        log.warning(
            "model %s: hard_cap %d tokens is under the longest request it admits (max_input_tokens %d + max_new_tokens "
            "%d = %d): longer requests are refused (input_too_long); raise hard_cap or lower max_input_tokens",
            model.name,
            engine.ceiling,
            model.max_input_tokens,
            model.max_new_tokens,
            longest,
        )
    runner = runner or serving_runner(resolved)
    return Consumer(
        model,
        config.kafka,
        config.consumer,
        runner=runner,
        engine=engine,
        consumer_id=consumer_id,
        prior_costs=measured.get("prior_costs", ()),
    )


class Consumer:
    """One model's consumer in one process: fetch, admit, drive the engine, dispatch, answer."""

    def __init__(
        self,
        model: ModelConfig,
        kafka: KafkaSettings,
        settings: ConsumerSettings,
        *,
        runner: Runner,
        engine: ServingPolicy,
        consumer_id: str | None = None,
        clock: Clock | None = None,
        prior_costs: Sequence[tuple[int, float]] = (),
    ) -> None:
        if settings.group_type == "share":  # the share group balances by pull: no forwarding hop
            settings = dataclasses.replace(settings, tail_forwarding=False)
        self.model = model
        self.kafka = kafka
        self.settings = settings
        self.runner = runner
        self.engine = engine
        self.clock: Clock = clock or SystemClock()
        self.consumer_id = consumer_id or default_consumer_id(model.name)
        self.topics = Topics(kafka.topic_prefix)
        self.request_topic = self.topics.requests(model.name)
        self.priority_topic = self.topics.priority(model.name)
        self.share = settings.group_type == "share"
        """Share mode (`consumers.sharing`): a share group instead of a partition group."""
        self.group_id = self.topics.share_group(model.name) if self.share else self.topics.group(model.name)
        self.stats = ConsumerStats()
        self._admission = Admission(model, runner, self.topics, settings.max_message_bytes)
        self._work = Work(self.clock, self._fail)
        self._room = asyncio.Event()
        self._alarm = Alarm(self.clock, self._drive)
        self._stopping = False
        self._failure: BaseException | None = None
        self._own_topics = {self.topics.results(model.name), self.priority_topic, *self.topics.shared}
        self._limits = TopicLimits(kafka)
        self._outcomes = Outcomes(Answers(model.name, self.consumer_id, self.topics, self._limits), self.stats)
        self.forwarding = PeerForwarding(
            self.consumer_id,
            model.name,
            self.group_id,
            self.priority_topic,
            settings,
            engine,
            self.clock,
            lambda: self._admission.offered_cost,
            decode_slots=model.profile.max_inflight_batches if model.batching == "iteration" else None,
            timed_steps=getattr(runner, "timed_steps", list),
        )
        self._prior_costs: list[tuple[int, float]] = list(prior_costs)
        self.membership = Membership(self.consumer_id, self.priority_topic, engine, self._admission, self._work.settle)
        self._clients: KafkaClients | ShareClients | None = None
        self._nudge: Callable[[], None] = lambda: None
        """Tells share members that the device or the queue changed (nothing in a partition group)."""
        self._device = Device(runner, model.profile.max_inflight_batches, self.clock, model.ttft_objective_ms)

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Load and warm the runner, then join the group (`consumers.warm_up`)."""
        if self.share:
            group = await prepare_share_group(self.kafka, self.group_id)
            enforce_lock(self.model, check_lock(self.model, self.engine.ceiling, self._prior_costs, group.lock_ms))
            log.info("consumer %s: share group %s, %s", self.consumer_id, self.group_id, describe_lock(group))
        self.stats.warm_up_sizes.extend(await self._device.warm_up(self.model.name, self.engine.ceiling))
        if self.share:
            await self._start_sharing()
            return
        self._clients = clients = await open_clients(self._client_plan())
        self.membership.join(
            clients.consumer, clients.publisher, [self.request_topic, self.priority_topic], clients.stable_start
        )
        self.forwarding.start(self.kafka, self.settings.fleet_beacon_ms, self.beacon)

    def _client_plan(self) -> ClientPlan:
        return ClientPlan(
            self.kafka,
            self.group_id,
            self.consumer_id,
            frozenset(self.topics.shared),
            frozenset(self._own_topics),
            self.topics.results(self.model.name),
            self.priority_topic,
            self._limits,
            self.settings.max_queue,
            self.stats,
            self.clock,
        )

    async def _start_sharing(self) -> None:
        slots = self.model.profile.max_inflight_batches
        engine, device, forwarding, rule = self.engine, self._device, self.forwarding, PullRule()

        def may_pull() -> int:
            """The pull rule: records a poll may take, only while the device has a free slot: up to a
            full batch with what waits, less for a member clearly slower than a peer
            (`pipeline.core.engine.share_pull`)."""
            if device.computing >= slots:
                return 0
            now = self.clock.now_ms()
            view = forwarding.view(now)
            bound = pull_bound(
                None if view is None else view.t_ms,
                0.0 if view is None else capacity_per_s(view),
                engine.ceiling,
                forwarding.peers(),
                now,
                rule,
                batches=forwarding.batches,
                measured_at_ms=forwarding.measured_at_ms,
            )
            return self._records_in(bound.units - engine.pending)

        self._clients = clients = await open_share_clients(
            self._client_plan(),
            request_topic=self.request_topic,
            members=slots + 1,
            max_records=self.engine.ceiling,
            may_pull=may_pull,
        )
        self._nudge = clients.fetcher.nudge

        def drained() -> None:
            """A poll left the broker empty: told at once only where a slower peer pulls by it."""
            now = self.clock.now_ms()
            view = forwarding.view(now)
            capacity, unit = (0.0, None) if view is None else (capacity_per_s(view), view.t_ms(1))
            at_once = outpaces_a_peer(capacity, unit, forwarding.batches, forwarding.peers(), now, rule)
            forwarding.drained(now, at_once=at_once)

        clients.fetcher.on_drained = drained
        self.forwarding.start(self.kafka, self.settings.fleet_beacon_ms, self.beacon)
        if self.forwarding.fleet is not None:
            self.forwarding.fleet.on_heard = clients.fetcher.nudge
        log.info("consumer %s: joined share group %s", self.consumer_id, self.group_id)

    def _records_in(self, units: int) -> int:
        """How many records make about `units` cost units (a token-costed model: by the mean cost of
        the records admitted so far)."""
        if units <= 0 or self.model.profile.cost_unit == "requests" or not self.stats.fetched:
            return max(0, units)
        return max(1, round(units * self.stats.fetched / max(1, self._admission.offered_cost)))

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then stop fetching, finish what is held, commit, close: all
        within `stop_timeout_s` (`consumers.stop_budget`), whatever the broker does."""
        fetch = asyncio.create_task(self._fetch_loop(stop), name="fetch")
        commit = (
            None
            if self.kafka.transactional
            else asyncio.create_task(
                self.membership.commit_every_interval(self.settings.commit_interval_ms), name="commit"
            )
        )
        budget = None
        try:
            await fetch
            budget = StopBudget.starting(self.clock.monotonic_s(), self.settings.stop_timeout_s)
            await self._finish(budget)
        finally:
            if commit is not None:
                commit.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await commit
            await self._close(budget)
        if self._failure is not None:
            raise self._failure

    async def _finish(self, budget: StopBudget) -> None:
        """The work share of the stop: keep dispatching what is held, then commit what it answered."""
        clock = self.clock
        while (self.engine.pending or self._work.busy) and budget.working(clock.monotonic_s()):
            if self._failure is not None:
                return
            self._drive()
            await asyncio.sleep(0.005)
        await self._work.settle(budget.work_left_s(clock.monotonic_s()))
        try:
            await asyncio.wait_for(self.membership.commit(), step_s(budget, clock.monotonic_s(), 3))
        except TimeoutError:
            log.warning(
                "consumer %s: the last commit did not finish; the group re-reads from the one before", self.consumer_id
            )

    async def _close(self, budget: StopBudget | None) -> None:
        """The Kafka clients share what is left of the stop budget (aiokafka can wait forever for a
        broker that is gone); CLIENT_STOP_S each when the consumer ends by an error."""
        self._alarm.cancel()
        await self.forwarding.stop()
        name, now, clients = f"consumer {self.consumer_id}", self.clock.monotonic_s, self._clients
        if clients is not None:
            await clients.stop_consumer(name, step_s(budget, now(), 2))
        abandoned = await self._work.abandon()
        if abandoned:  # their offsets stay uncommitted: the group gets these records again
            log.warning("%s: %d batches or answers unfinished at stop; left for redelivery", name, abandoned)
        if clients is not None:
            await clients.stop_producer(name, step_s(budget, now(), 1))
        self._device.close()

    def beacon(self) -> FleetBeacon:
        """What this consumer tells its group now (the lag events carry its capacity too)."""
        return self.forwarding.beacon(self.clock.now_ms(), self.membership.owned_priority(), self._free_slots)

    @property
    def _free_slots(self) -> int:
        return max(0, self.model.profile.max_inflight_batches - self._device.computing)

    def _fail(self, error: BaseException) -> None:
        """An error no record explains (a bug, or a transactional producer fenced by its successor):
        stop without committing past it, so what it held is redelivered."""
        if self._failure is None:
            log.error("consumer %s stopping after error: %r", self.consumer_id, error)
            self._failure = error
        self.membership.stop_committing()
        self._stopping = True
        self._room.set()

    # ---- fetch and admit ---------------------------------------------------

    async def _fetch_loop(self, stop: asyncio.Event) -> None:
        clients = self._clients
        assert clients is not None
        fetcher, tracker = clients.fetcher, clients.publisher.tracker
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
                self._intake(records, tracker)
            self.stats.backlog = fetcher.backlog(tracker.next_offset)
            self._drive()

    def _intake(
        self, records: dict[TopicPartition, list[ConsumerRecord]], tracker: OffsetTracker[TopicPartition]
    ) -> None:
        now = self.clock.now_ms()
        rejected = self._admission.intake(records, now, tracker, self.engine)
        self.stats.fetched += sum(len(batch) for batch in records.values())
        self.stats.stale_offset_records_skipped = self._admission.skipped_answered
        self.stats.queue = queued = self.engine.pending
        self.stats.max_queue_seen = max(self.stats.max_queue_seen, queued)
        if rejected:
            self._send(self._outcomes.of_refusals(rejected, int(now), int(self.clock.now_ms())))

    # ---- drive the engine and dispatch --------------------------------------

    def _drive(self) -> None:
        """Ask the engine what to do now; called on arrivals, completions and wake-ups."""
        if self._failure is not None:
            return
        now, slots = self.clock.now_ms(), self.model.profile.max_inflight_batches
        if self.forwarding.due(now, device_free=self._device.computing < slots):
            self._forward(now)
        step = poll_engine(self.engine, now, self._device.computing, slots, self.stats.backlog)
        if step.expired:
            for pr in step.expired:
                self._admission.unwait(pr.payload)
            self._send(self._outcomes.of_expiry(step.expired, now))
        for batch in step.batches:
            self._dispatch(batch, now)
        self._alarm.set(step.wake_at_ms)
        self.stats.queue = queued = self.engine.pending
        if queued < self.settings.max_queue:
            self._room.set()
        self._nudge()

    def _forward(self, now: float) -> None:
        """Hand the back of the queue to faster peers (`consumers.forwarding`)."""
        chosen = self.forwarding.plan(
            now, self._admission.waiting.values(), self._limits.cached(self.priority_topic), self._free_slots
        )
        if not chosen:
            return
        for pr, _ in chosen:
            self.engine.withdraw(pr)
            self._admission.unwait(pr.payload)
        self.stats.forwarded += len(chosen)
        self._send(Reply([m for _, m in chosen], [pr.payload for pr, _ in chosen]), remember=False)

    def _dispatch(self, batch: Batch, now: float) -> None:
        self.forwarding.dispatched(batch, now)
        for pr in batch.requests:
            self._admission.running(pr.payload)
        self.stats.batches += 1
        self._device.reserve()
        self._work.run_batch(self._run_batch(batch, now))

    async def _run_batch(self, batch: Batch, dispatch_ms: float) -> None:
        try:
            ran = await self._device.run(batch)
            self.forwarding.answered(batch, ran.outputs, ran.end_ms)
        finally:
            self.forwarding.left_device(batch)
        self.engine.completed(batch, ran.end_ms, ran.compute_ms)
        self.forwarding.measured(ran.compute_ms)
        self._drive()
        timing = BatchTiming(
            int(dispatch_ms), int(ran.start_ms), int(ran.end_ms), int(self.clock.now_ms()), *ran.memory
        )
        try:
            await self._publish(self._outcomes.of_batch(batch, ran.outputs, ran.failures, timing, ran.compute_ms))
        finally:
            self._admission.done_running([pr.payload.request.id for pr in batch.requests])

    # ---- publishing ------------------------------------------------------------

    def _send(self, reply: Reply, *, remember: bool = True) -> None:
        self._work.publish(self._publish(reply, remember=remember))

    async def _publish(self, reply: Reply, *, remember: bool = True) -> None:
        """Publish, then count the requests (and the reply's offsets) as answered (unless self-fenced)."""
        assert self._clients is not None
        if await self._clients.publisher.publish(reply.messages, reply.places, refused=reply.offsets):
            self._admission.published([h.request.id for h in reply.answered], remember=remember)
