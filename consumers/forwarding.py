"""Forwards: a waiting request handed to a faster peer through a priority partition it owns.

Which requests go, and to whom, is `pipeline.core.engine.peer_forwarding.plan_forwards`,
from the peers' beacons (`consumers.fleet` publishes this consumer's and
reads theirs). `PeerForwarding` is this consumer's side of that balance:
what its beacon says (how soon it could start one more request, from the
engine's learned t(b) and the batches on its device), and, at most every
`FORWARD_SCAN_INTERVAL_MS` and before every poll of the engine with a free
device slot (the batch about to start is the one a peer may relieve), which
waiting requests leave and the records they travel as (the loop then
withdraws them from the engine and publishes). Its offered and served
rates (`Flow`) make its load, which its beacon carries.

A generating consumer with iteration-level batching balances in
generation's units instead (`pipeline.core.engine.decode_forwarding`): its
`DecodeLedger` learns, from what it dispatches and the answers' token
stamps, its first-token time and its decode step by rows, and from the
decode loop's timed plain steps (`timed_steps`, drained before every use)
the pace its steps go at now, so a slowdown shows within a few steps, not
when the answers that ran through it end; its beacon says
how soon one more request could start its prefill and what its steps cost;
and every waiting request, a lone arrival included, goes to the peer that
gives it the earlier first token without a later answer. What is on the
device already (running, or joining the running set) is never moved.

The forward carries the original record time in a header (waiting keeps
counting from the first enqueue), and the header doubles as the loop guard:
a request that arrived as a forward is never forwarded again. Exactly-once
answering rests on three rules: the original's offset is acknowledged only
after the forward is on the broker, the forwarding consumer withdraws it
from its own engine, and every consumer remembers the ids it answered
(`consumers.intake.RecentIds`) to drop stray duplicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from consumers.answers import Held
from consumers.clock import Clock
from consumers.fleet import Fleet
from consumers.intake import ORIG_TS_HEADER
from consumers.runners.base import Output
from pipeline.core.config import ConsumerSettings, KafkaSettings
from pipeline.core.engine.decisions import Batch, PendingRequest, ServingPolicy
from pipeline.core.engine.decode_forwarding import DecodeLedger, DecodeRule, plan_decode_forwards
from pipeline.core.engine.peer_forwarding import (
    Flow,
    Forward,
    ForwardRule,
    LocalView,
    MemberView,
    beacon_view,
    curve_view,
    dispatch_order,
    peers_after,
    plan_forwards,
    recent_batch_ms,
)
from pipeline.core.kafka.outbox import Message
from schemas.messages import FleetBeacon

FORWARDED_BY_HEADER = "batchtide-forwarded-by"
"""Which consumer forwarded the request (for tracing; not trusted for logic)."""
FORWARD_SCAN_INTERVAL_MS = 20.0
"""Looking for requests a peer would finish sooner scans the local queue; at most this often."""


def forward_headers(held: Held, consumer_id: str) -> list[tuple[str, bytes]]:
    return [
        (ORIG_TS_HEADER, str(held.enqueue_ms).encode()),
        (FORWARDED_BY_HEADER, consumer_id.encode()),
    ]


class PeerForwarding:
    """One consumer's beacon and its forwards to faster peers (`fleet` is None until started,
    and stays None when `fleet_beacon_ms` is 0); `decode_slots`: an iteration-level generating
    consumer's device slots (it then balances in generation's units)."""

    def __init__(
        self,
        consumer_id: str,
        model: str,
        group_id: str,
        priority_topic: str,
        settings: ConsumerSettings,
        engine: ServingPolicy,
        clock: Clock,
        offered_total: Callable[[], int] = lambda: 0,
        decode_slots: int | None = None,
        timed_steps: Callable[[], list[tuple[int, float]]] = list,
    ) -> None:
        """`offered_total()`: cost units offered to the engine so far (from the intake);
        `timed_steps()`: the decode loop's plain steps (rows, ms) timed since the last call."""
        self._consumer_id = consumer_id
        self._model = model
        self._group_id = group_id
        self._priority_topic = priority_topic
        self._engine = engine
        self._clock = clock
        self._scanning = settings.tail_forwarding
        self._rule = ForwardRule(min_gain_ms=settings.forward_min_gain_ms, gain_share=settings.forward_gain_share)
        self._last_scan_ms = 0.0
        self._batch_ms = 0.0
        """Recent batch compute time (a moving average): what the group is told a forward costs here."""
        self.batches = 0
        """Batches measured since the start: the evidence behind this consumer's capacity."""
        self.measured_at_ms: float | None = None
        """When the newest of them ended (None before the first)."""
        self.drained_at_ms: float | None = None
        """Share mode: when a request poll last left the broker empty (its beacon says it at once)."""
        self._offered_total = offered_total
        self._offered_seen = 0
        self._flow = Flow()
        self._busy_until: dict[int, float] = {}
        """Expected end (wall-clock ms, from the learned t(b)) of each batch on the device."""
        self.fleet: Fleet | None = None
        self.decode = DecodeLedger(decode_slots) if decode_slots else None
        """The decode loop's measures (generation, iteration-level); None for a consumer that runs batches."""
        self._timed_steps = timed_steps
        self._decode_rule = DecodeRule(min_gain_ms=settings.forward_min_gain_ms, gain_share=settings.forward_gain_share)

    def start(self, kafka: KafkaSettings, beacon_ms: float, beacon: Callable[[], FleetBeacon]) -> None:
        """Publish `beacon()` every `beacon_ms` and listen to the peers'."""
        if beacon_ms <= 0:
            return
        self.fleet = Fleet(kafka, self._group_id, self._consumer_id, beacon_ms, beacon, self._clock)
        self.fleet.start()

    async def stop(self) -> None:
        if self.fleet is not None:
            await self.fleet.stop()

    # ---- the device's state, as the group is told it ----------------------------

    def _sync(self) -> None:
        """The decode loop's steps timed since the last look, into its ledger (in the order they ran)."""
        if self.decode is not None:
            for rows, ms in self._timed_steps():
                self.decode.stepped(rows, ms)

    def dispatched(self, batch: Batch, now_ms: float) -> None:
        self._flow.served(now_ms, batch.record.cost)
        self._busy_until[batch.batch_id] = now_ms + (self._engine.curve.estimate_ms(batch.record.cost) or 0.0)
        if self.decode is not None:
            self._sync()
            for pr in batch.requests:
                self.decode.dispatched(pr.request_id, now_ms, pr.payload.tokens_out)

    def answered(self, batch: Batch, outputs: dict[int, Output], now_ms: float) -> None:
        """A batch's answers: the decode loop's first-token time, step and answer length are learned
        from those that ran (a refused or expired answer teaches nothing; it only leaves)."""
        if self.decode is None:
            return
        self._sync()
        for index, pr in enumerate(batch.requests):
            out = outputs.get(index)
            if out is None or out.refused or out.expired:
                self.decode.left(pr.request_id, now_ms)
            else:
                self.decode.answered(pr.request_id, now_ms, out.first_token_ms, out.last_token_ms, out.tokens_out)

    def left_device(self, batch: Batch) -> None:
        self._busy_until.pop(batch.batch_id, None)
        if self.decode is not None:
            now = self._clock.now_ms()
            for pr in batch.requests:
                self.decode.left(pr.request_id, now)

    def measured(self, compute_ms: float) -> None:
        self._batch_ms = recent_batch_ms(self._batch_ms, compute_ms, self._rule)
        self.batches += 1
        self.measured_at_ms = self._clock.now_ms()

    def drained(self, now_ms: float, *, at_once: bool) -> None:
        """A share member's poll brought fewer records than it asked for: whatever waits on the broker
        now arrived after `now_ms`. With `at_once` (a slower peer pulls by it) the peers hear it now,
        not at the next interval."""
        self.drained_at_ms = now_ms
        if at_once and self.fleet is not None:
            self.fleet.send_soon()

    def view(self, now_ms: float) -> LocalView | None:
        """This consumer's state for the balance: device time left, learned t(b), offered and served rates."""
        total = self._offered_total()
        if total > self._offered_seen:
            self._flow.offered(now_ms, total - self._offered_seen)
            self._offered_seen = total
        return curve_view(self._engine.curve, self.busy_for(now_ms), *self._flow.rates_per_ms(now_ms))

    def peers(self) -> list[MemberView]:
        """The newest beacon of every peer (none before the fleet starts, or without beacons)."""
        return [] if self.fleet is None else self.fleet.peers()

    def busy_for(self, now_ms: float) -> float:
        """Device time left on the batches running now, as t(b) predicted them."""
        return max(0.0, max((end - now_ms for end in self._busy_until.values()), default=0.0))

    def beacon(self, now_ms: float, partitions: tuple[int, ...], free_slots: int = 0) -> FleetBeacon:
        """What this consumer tells its group: how soon it could start one more request (`free_slots`:
        its device's, for a decode loop's room)."""
        engine = self._engine
        local = self.view(now_ms)
        view = beacon_view(self._consumer_id, now_ms, engine.pending, local, self._batch_ms, partitions)
        unit_ms = None if local is None else local.t_ms(1)
        if self.decode is not None:
            self._sync()
            state = self.decode.state(now_ms, free_slots, engine.pending)
            return FleetBeacon(
                member_id=view.member_id,
                model=self._model,
                group=self._group_id,
                at_ms=int(now_ms),
                start_in_ms=state.start_in_ms,
                batch_ms=view.batch_ms,
                capacity_per_s=view.capacity_per_s,
                partitions=list(view.partitions),
                load=view.load,
                first_token_ms=state.first_token_ms,
                decode_steps=list(state.steps),
                running=state.running,
                room=state.room,
                slot_every_ms=state.slot_every_ms,
                batches=self.batches,
                unit_ms=unit_ms,
                drained_at_ms=self.drained_at_ms,
            )
        return FleetBeacon(
            member_id=view.member_id,
            model=self._model,
            group=self._group_id,
            at_ms=int(now_ms),
            start_in_ms=view.start_in_ms,
            batch_ms=view.batch_ms,
            capacity_per_s=view.capacity_per_s,
            partitions=list(view.partitions),
            load=view.load,
            batches=self.batches,
            unit_ms=unit_ms,
            drained_at_ms=self.drained_at_ms,
        )

    # ---- which requests leave --------------------------------------------------

    def due(self, now_ms: float, device_free: bool = False) -> bool:
        """Time for a scan (and it counts as made): every scan interval, and before a poll with a
        free device slot while more than one request waits (a decode loop: while one waits, so that
        every arrival is placed before it starts)."""
        if not self._scanning:
            return False
        before_poll = device_free and self._engine.pending > self._keeps_alone
        if not before_poll and now_ms - self._last_scan_ms < FORWARD_SCAN_INTERVAL_MS:
            return False
        self._last_scan_ms = now_ms
        return True

    @property
    def _keeps_alone(self) -> int:
        """A queue this long is never scanned before a poll: one lone request starts at once on a
        batch device (nothing to gain), while a decode loop places every arrival."""
        return 0 if self.decode is not None else 1

    def plan(
        self, now_ms: float, waiting: Iterable[PendingRequest], room: int | None, free_slots: int = 0
    ) -> list[tuple[PendingRequest, Message]]:
        """The back of the queue that peers would finish clearly sooner, each with the record that
        takes it to a priority partition its peer owns (`room`: the priority topic's
        `max.message.bytes`, None while unknown: a forward it would refuse stays here;
        `free_slots`: the device's, a decode loop's room)."""
        fleet = self.fleet
        engine = self._engine
        if fleet is None or engine.pending <= self._keeps_alone:
            return []
        queue = dispatch_order(waiting)
        movable = [not pr.payload.forwarded_in for pr in queue]
        ordered = peers_after(self._consumer_id, fleet.peers())
        if not ordered or not any(movable):
            return []
        if self.decode is not None:
            self._sync()
            decoders = fleet.decode_peers()
            plan = plan_decode_forwards(
                [pr.payload.tokens_out for pr in queue],
                movable,
                self.decode.local(now_ms, free_slots),
                [decoders[p.member_id] for p in ordered if p.member_id in decoders],
                now_ms,
                dataclasses.replace(self._decode_rule, hop_ms=fleet.hop_ms),
                fleet.sent,
            )
            return self._messages(queue, plan, room)
        view = self.view(now_ms)
        if view is None:
            return []
        rule = dataclasses.replace(self._rule, hop_ms=fleet.hop_ms)
        plan = plan_forwards(len(queue), movable, view, ordered, now_ms, rule, fleet.sent)
        return self._messages(queue, plan, room)

    def _messages(
        self, queue: list[PendingRequest], plan: list[Forward], room: int | None
    ) -> list[tuple[PendingRequest, Message]]:
        """Each planned forward with the record that takes it to its peer's priority partition."""
        chosen: list[tuple[PendingRequest, Message]] = []
        for forward in plan:
            pr = queue[forward.index]
            held: Held = pr.payload
            message = Message(
                self._priority_topic,
                held.request.id.encode(),
                held.raw,
                forward_headers(held, self._consumer_id),
                partition=forward.partition,
            )
            if room is None or message.size > room:
                continue
            chosen.append((pr, message))
        return chosen
