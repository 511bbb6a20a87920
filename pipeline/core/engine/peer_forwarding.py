"""Group-relative forwarding: hand a waiting request to the peer that would finish it sooner.

Kafka's assignors spread partitions by count, not by speed, so a consumer
on a slower device (an older card, a throttled one, a co-tenant model) or
on a hot partition builds a queue that its faster peers never see. Every
consumer of a model's group therefore says, several times a second, how
soon a request handed to it now would start, how long its batches take now
and its capacity (`MemberView`, the consumer's beacon). Each consumer
compares, for the requests at the back of its own queue, when it would
finish them itself with when the best peer would, one Kafka hop later;
when the peer is clearly sooner the request goes to a partition of the
priority topic that the peer owns, which it pulls first.

Clearly sooner means by at least `min_gain_ms` and by `gain_share` of the
local device's time for the batch its queue makes now: between equal
consumers the predictions differ by noise of about a batch, and a forward
costs two Kafka hops and a commit, so they keep their own work.

A peer that is clearly less loaded (its own traffic over its capacity at
most `relief_load` times the local one: a faster device, or one off the hot
partition) is not noise, and two things change for it (`relieved`): the
margin drops to `relief_gain_ms`, and the local prediction counts the
requests that will join the request's batch before the device frees (the
local served rate x the device time left). Without them a loaded consumer
kept every request whose predicted finish was within the margin of its
peer's, and the requests arriving after that prediction grew the batch past
it: in the simulator the slow device of the 2-consumer straggler ran
batches of 8-10 (p99 2.46x the all-fast group's, 1.90x with relief) and the
hot consumer of 4 batches of ~40 (1.70x, 1.13x). `relief_load` is 0.6, not
closer to 1, because a learned capacity under CPU contention is noisy by
tens of percent, and twins must not read that as relief.

Each request forwarded to a peer adds one request's share of its time
(1 / capacity) to its predicted start until the peer's next beacon, so one
scan never floods it. A start time within one batch (only the running
batch ahead, no queue) ages with the beacon, down to `phase_share` of the
peer's batch time and no lower: a beacon older than its start time
describes a device that has since begun another batch, at a phase the
forwarder cannot know (half a batch on average); this took the straggler
from 1.90x to 1.82x. A longer start time is not aged: the peer keeps
receiving its own traffic meanwhile. Aged to zero, views made a fleet of 16
with two stragglers flood its fastest-looking peers (p99 2.9x the all-fast
fleet against 1.35x) and equal consumers forward back and forth.

A peer that has measured nothing yet (it joined, or its partitions are
quiet) is assumed as fast as the forwarding consumer and gets one request
per beacon, enough for it to measure itself; peers without priority
partitions get none. A request that arrived as a forward is never forwarded
again (the caller leaves it out), so nothing ping-pongs.

Pure: no clock, no Kafka. The consumer calls it with wall-clock times and
its beacons; the simulator with virtual ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from pipeline.core.engine.decisions import LearnedCost, PendingRequest
from pipeline.core.engine.window import ArrivalRate

DEFAULT_MIN_GAIN_MS = 20.0
DEFAULT_GAIN_SHARE = 0.35
DEFAULT_RELIEF_LOAD = 0.6
DEFAULT_RELIEF_GAIN_MS = 5.0
RATE_HALFLIFE_MS = 1000.0
"""Half-life of the offered and served rates behind `load` and `served_per_ms`: a second, so
that Poisson noise between equal consumers does not read as a difference in load."""


@dataclass(frozen=True)
class MemberView:
    """What one consumer last said of itself: the beacon, as of `at_ms`."""

    member_id: str
    at_ms: float
    start_in_ms: float
    """How long a request handed to it at `at_ms` would wait for the device (busy time left plus
    the queue ahead at its throughput)."""
    batch_ms: float
    """Its recent batch compute time: what a forwarded request that joins its next batch costs,
    beside its own traffic."""
    capacity_per_s: float
    """Cost units per second at its knee; 0 while it has measured nothing."""
    partitions: tuple[int, ...]
    """Partitions of the model's priority topic it owns: where work for it goes."""
    load: float | None = None
    """Cost units of its own traffic offered to it per second (its partitions, forwards in left
    out) over its capacity; None when its beacon does not say (an older consumer). Forwards in
    are left out so that the balance never feeds its own measure: counted, the requests one
    consumer handed to another made that one look loaded, and it handed its own on in turn (live,
    four consumers under CPU contention forwarded 97% of the requests)."""
    batches: int | None = None
    """Batches it has measured since it started (None: its beacon does not say): how much its
    capacity is worth as evidence."""
    unit_ms: float | None = None
    """Its learned t(1) (None when its beacon does not say): beside the capacity, which reads the
    throughput at the largest batch it measured, a speed that does not depend on its load."""
    drained_at_ms: float | None = None
    """Share mode: when its newest poll that left the broker empty (fewer records than it asked
    for) returned; None when its beacon does not say."""


@dataclass(frozen=True)
class LocalView:
    """The forwarding consumer's own state at the scan."""

    busy_for_ms: float
    """Device time left on the batches running now (0 when the device is free)."""
    cap: int
    """Batch size a backlog is served at."""
    t_ms: Callable[[int], float]
    """Its t(b), from the engine's learned curve."""
    served_per_ms: float = 0.0
    """Cost units it dispatches per ms (what it keeps): the rate at which requests join its queue."""
    load: float = 0.0
    """Its offered load over its capacity, as its beacon says it (`MemberView.load`)."""


@dataclass(frozen=True)
class ForwardRule:
    min_gain_ms: float = DEFAULT_MIN_GAIN_MS
    gain_share: float = DEFAULT_GAIN_SHARE
    hop_ms: float = 10.0
    """One Kafka round trip (produce, then the peer's fetch), measured from the beacons' delay."""
    stale_ms: float = 2000.0
    """A beacon older than this is a peer that may be gone: it gets no work."""
    batch_ms_weight: float = 0.2
    """Weight of the newest batch in the recent batch time a beacon carries."""
    relief_load: float = DEFAULT_RELIEF_LOAD
    """A peer whose load is at most this times the local load is clearly less loaded."""
    relief_gain_ms: float = DEFAULT_RELIEF_GAIN_MS
    """The margin a forward to a clearly less loaded peer must gain."""
    phase_share: float = 0.5
    """A peer's start time ages with its beacon down to this share of its batch time, no lower."""


@dataclass(frozen=True)
class Forward:
    index: int
    """Position of the request in the `queue` passed to `plan_forwards`."""
    member_id: str
    partition: int


def local_finish_ms(position: int, queue_len: int, local: LocalView, joining: bool = False) -> float:
    """When the request at `position` of a dispatch-ordered queue of `queue_len` would finish
    here: the running batches, the full batches ahead of it, then its own batch (`joining`: grown
    by the requests kept until the device frees, when it is the last batch)."""
    cap = max(1, local.cap)
    ahead = position // cap
    own = queue_len - ahead * cap
    if joining and own <= cap:
        own += int(local.served_per_ms * local.busy_for_ms)
    return local.busy_for_ms + ahead * local.t_ms(cap) + local.t_ms(min(cap, own))


def relieved(peer: MemberView, local: LocalView, rule: ForwardRule) -> bool:
    """The peer is clearly less loaded than the local consumer (a faster device, a cooler
    partition), not a twin that differs by noise."""
    return (
        peer.load is not None
        and peer.capacity_per_s > 0
        and local.load > 0
        and peer.load <= rule.relief_load * local.load
    )


def peer_finish_ms(
    peer: MemberView, extra: int, rule: ForwardRule, unmeasured_ms: float = 0.0, age_ms: float = 0.0
) -> float:
    """When `peer` would finish one more request handed to it now, after `extra` already sent
    since its beacon (`unmeasured_ms`: its batch time while it has measured none), its beacon
    `age_ms` old (the start time ages down to `rule.phase_share` of a batch: the module's docstring)."""
    start = peer.start_in_ms
    if 0 < age_ms and start <= peer.batch_ms:
        start = max(start - age_ms, min(start, rule.phase_share * peer.batch_ms))
    if peer.capacity_per_s <= 0:
        return math.inf if extra else rule.hop_ms + start + unmeasured_ms
    return rule.hop_ms + start + extra * 1000.0 / peer.capacity_per_s + peer.batch_ms


def plan_forwards(
    queue_len: int,
    movable: Sequence[bool],
    local: LocalView,
    peers: Sequence[MemberView],
    now_ms: float,
    rule: ForwardRule,
    sent: dict[str, int] | None = None,
) -> list[Forward]:
    """Which of the waiting requests to hand to which peer, back of the queue first.

    Among equally good peers the first in `peers` wins: pass them `peers_after` the caller, so
    that the forwarders of a group do not all pick the same few. `movable[i]` says whether the request at dispatch position i may leave (not a forward
    itself); `sent` counts requests already handed to each peer since its current beacon and is
    updated in place. The scan stops at the first position that no peer beats: the requests
    ahead of it finish sooner here still.
    """
    sent = {} if sent is None else sent
    usable = [p for p in peers if p.partitions and now_ms - p.at_ms <= rule.stale_ms]
    if not usable or queue_len == 0:
        return []
    single = local.t_ms(1)
    margin = max(rule.min_gain_ms, rule.gain_share * local.t_ms(min(max(1, local.cap), queue_len)))

    def finish(peer: MemberView) -> float:
        return peer_finish_ms(peer, sent.get(peer.member_id, 0), rule, single, now_ms - peer.at_ms)

    chosen: list[Forward] = []
    remaining = queue_len
    for position in range(queue_len - 1, -1, -1):
        if not movable[position]:
            continue
        best = min(usable, key=finish)
        there = finish(best)
        relief = relieved(best, local, rule)
        here = local_finish_ms(position, remaining, local, joining=relief)
        if here - there < (rule.relief_gain_ms if relief else margin):
            break
        count = sent.get(best.member_id, 0)
        partition = best.partitions[count % len(best.partitions)]
        chosen.append(Forward(position, best.member_id, partition))
        sent[best.member_id] = count + 1
        remaining -= 1
    return chosen


def start_in_ms(queue_len: int, local: LocalView) -> float:
    """What a consumer says in its beacon: how long a request handed to it now would wait for
    the device (the same model of its queue as `local_finish_ms`)."""
    cap = max(1, local.cap)
    return local.busy_for_ms + (queue_len // cap) * local.t_ms(cap)


def curve_view(
    curve: LearnedCost, busy_for_ms: float, offered_per_ms: float = 0.0, served_per_ms: float = 0.0
) -> LocalView | None:
    """A consumer's LocalView from its engine's learned curve and its offered and served rates
    (cost units per ms); None before it measured a batch."""
    if curve.estimate_ms(1) is None:
        return None

    def t_ms(size: int) -> float:
        return curve.estimate_ms(size) or 0.0

    view = LocalView(busy_for_ms=busy_for_ms, cap=curve.cap, t_ms=t_ms, served_per_ms=served_per_ms)
    capacity = capacity_per_s(view)
    return replace(view, load=offered_per_ms * 1000.0 / capacity if capacity > 0 else 0.0)


def capacity_per_s(view: LocalView) -> float:
    """Cost units per second at the knee: what the group's balance compares members by."""
    time_ms = view.t_ms(view.cap)
    return view.cap * 1000.0 / time_ms if time_ms > 0 else 0.0


def dispatch_order(waiting: Iterable[PendingRequest]) -> list[PendingRequest]:
    """The waiting requests in the order the engine takes them: marked, then client priority
    level, then record time."""
    return sorted(waiting, key=lambda r: (not r.marked, 0 if r.marked else r.priority, r.enqueue_ms))


def peers_after(member_id: str, peers: Iterable[MemberView]) -> list[MemberView]:
    """The peers in member-id order, starting after `member_id` (each forwarder breaks ties
    towards a different peer), without the member itself."""
    ordered = sorted((p for p in peers if p.member_id != member_id), key=lambda p: p.member_id)
    later = [p for p in ordered if p.member_id > member_id]
    return later + [p for p in ordered if p.member_id < member_id]


def recent_batch_ms(previous: float, took_ms: float, rule: ForwardRule) -> float:
    """The moving average of batch compute times a beacon carries (the first batch sets it)."""
    return previous + rule.batch_ms_weight * (took_ms - previous) if previous > 0 else took_ms


def beacon_view(
    member_id: str, now_ms: float, queue_len: int, local: LocalView | None, batch_ms: float, partitions: tuple[int, ...]
) -> MemberView:
    """What a consumer says of itself: its start time, the time of the batch a request handed to
    it now would run in (its recent batch time, t(1) before any batch, and never less than its
    partial batch waiting now makes it), its capacity and load; all zero before it has measured
    anything.

    The waiting partial batch matters: a consumer whose queue is short of a full batch says it can
    start at once, and with its recent batch time alone its peers read it as fast while the batch
    its queue makes is long; live, four equal consumers under CPU contention then forwarded most
    of their requests to each other, each forward growing the next batch of its receiver."""
    if local is None:
        return MemberView(member_id, now_ms, 0.0, 0.0, 0.0, partitions)
    cap = max(1, local.cap)
    partial = min(cap, queue_len % cap + 1)
    return MemberView(
        member_id,
        now_ms,
        start_in_ms(queue_len, local),
        max(batch_ms or local.t_ms(1), local.t_ms(partial)),
        capacity_per_s(local),
        partitions,
        local.load,
    )


class Flow:
    """A consumer's offered and served rates in cost units (the balance's `load` and
    `served_per_ms`): offered counts its own traffic (forwards in left out, `MemberView.load`);
    served counts what it dispatches."""

    def __init__(self, halflife_ms: float = RATE_HALFLIFE_MS) -> None:
        self._offered = ArrivalRate(halflife_ms)
        self._served = ArrivalRate(halflife_ms)

    def offered(self, now_ms: float, cost: int) -> None:
        self._offered.observe(now_ms, cost)

    def served(self, now_ms: float, cost: int) -> None:
        self._served.observe(now_ms, cost)

    def rates_per_ms(self, now_ms: float) -> tuple[float, float]:
        """(offered, served) cost units per ms now."""
        return self._offered.cost_per_ms(now_ms), self._served.cost_per_ms(now_ms)
