"""Forwarding in generation's units: a waiting request goes to the peer that gives it the earlier first token.

`peer_forwarding` balances devices that run batches: there a request's time
is the wait for the device plus one batch. An iteration-level consumer
serves a decode loop instead: a request joins the running set between steps
while the device has room (a free slot: the KV cache its running set may
reserve), and then decodes among the other rows for as many steps as its
answer is long. A batch's time is the life of its request and tells a peer
nothing. So a generating consumer keeps its measures in generation's units
(`DecodeLedger`, from its own dispatches and answers):

- its first-token time: dispatch to first token of recent answers (the join
  and the prefill), their median;
- its decode step by rows: where the loop times its plain decode steps as
  they run (`stepped`), their curve at the pace of the last few steps
  (`decode_pace.StepPace`), times how much longer an answer's time per
  output token is than the plain steps it ran among (rides, prefills: the
  median of recent answers' ratio, which a slower device does not change),
  so a consumer that slows down mid-run says so within a few steps; until
  then, or where nothing times the steps, each answer's time per output
  token against the mean number of requests on its device during its life,
  in a `CostCurve` (bucket medians made non-decreasing; a shift, such as a
  co-tenant that starts taking half of the core, is re-learned);
- how long answers run: the median of recent answers' tokens (a request is
  expected to run the smaller of that and its max_new_tokens);
- its running set as it sees it: each request on the device with when it
  was dispatched and how long it is expected to run, so when room frees
  once every slot is taken.

Its beacon (`DecodeState`) says how soon one more request could start its
prefill (0 while it has room, else when the running request that frees a
slot for it is expected to end), its first-token time, its step curve, how
many requests it runs, its room and how often a running request ends once
it is full.

For each waiting request (back of the queue first, as in `peer_forwarding`),
its first token here is the wait for room plus the first-token time; its
last token comes one step per further token later, at the step of the rows
it would decode among; and its answer is weighed with the delay it adds to
those rows (each of their later steps grows by one row's share, for about
half an answer: `added_delay_ms`). At a peer: one hop later, the peer's wait
aged by its beacon's age, the requests already sent to it since that beacon
taking its room first and growing its rows. The peer with the earliest first
token (its answer breaking ties) gets the request when it is no later on
either (but for the hop itself, which any forward costs a first token) and
clearly earlier on one of them: by `min_gain_ms` and `gain_share` of the
time here (equal consumers' predictions differ by noise), or by only
`relief_gain_ms` when the peer's decode step is at most `relief_speed` times
the local one at rows both have measured (a device clearly faster, not
noise). The answer is delivered whole, so a first token gained at the price
of a later answer is no gain, and a faster answer that starts later breaks
the first-token promise: both must hold.

Nobody judges or is judged before LEARN_AFTER answers: a peer whose beacon
carries no decode step yet gets nothing (it learns from its own partitions'
requests; one request per beacon, as `peer_forwarding` gives a new peer,
is most of a generating consumer's traffic), and a consumer that has not
learned its own loop keeps what it has.

A request already on the device (running, or joining the running set) is
never moved: only the engine's waiting queue is planned over, and a request
that arrived as a forward stays where it is (the caller marks it).

Pure: no clock, no asyncio, no Kafka; every time is an argument.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.core.engine.buckets import interpolate
from pipeline.core.engine.costcurve import CostCurve
from pipeline.core.engine.decode_pace import StepPace
from pipeline.core.engine.peer_forwarding import Forward

DEFAULT_RELIEF_SPEED = 0.6
"""A peer whose decode step is at most this times the local one is a clearly faster device: the
same line `peer_forwarding` draws for load, for the same reason (CPU contention makes a learned
step noisy by tens of percent)."""
SAMPLES = 32
"""Recent answers the first-token time and the answer length are medians of."""
STEP_POINTS = 8
"""Points of the step curve a beacon carries at most."""
PACE_WEIGHT = 0.3
"""Weight of the newest answer in the ledger's pace (`DecodeLedger._pace`)."""
PACE_BOUNDS = (0.25, 4.0)
"""One answer moves the pace by at most this ratio's share."""
MIN_TIMED = 4
"""Timed plain steps an answer's life must span to tell its ratio to them."""
LEARN_AFTER = 8
"""Answers a consumer learns from before it judges (its own queue) or is judged (its beacon says
nothing of its decode loop until then): a curve of a few answers on a shared host is noise."""


@dataclass(frozen=True)
class DecodeState:
    """What a generating consumer says of its decode loop in its beacon."""

    start_in_ms: float
    """How long one more request handed to it now would wait for room (0 while it has room)."""
    first_token_ms: float
    """Dispatch to first token of one more request once it has room (the join and the prefill), at the
    rows it runs now; 0 before it learned its loop."""
    steps: tuple[tuple[int, float], ...]
    """Its decode step by requests on the device: (rows, ms), non-decreasing; empty before it learned."""
    running: int
    """Requests on its device now (running or joining)."""
    room: int
    """Requests it could start now beyond its waiting queue (free device slots)."""
    slot_every_ms: float
    """Once it is full, how often one of its running requests ends (a slot frees)."""


@dataclass(frozen=True)
class DecodeLocal:
    """The forwarding consumer's decode loop at the scan (from its `DecodeLedger`)."""

    ends_ms: tuple[float, ...]
    """When each request on the device is expected to end, from now, soonest first."""
    first_token_steps: float
    """Dispatch to first token in decode steps at the rows it joined (`DecodeLedger.first_token_steps`)."""
    steps: tuple[tuple[int, float], ...]
    room: int
    """Free device slots now."""
    slot_every_ms: float
    typical_tokens: int
    """What an answer here runs (median of recent answers); 0 before any."""
    idle_ms: float = 0.0
    """Since it last dispatched a request (infinite before any)."""

    @property
    def running(self) -> int:
        return len(self.ends_ms)

    def first_token_ms(self, rows: int) -> float:
        """Dispatch to first token of a request that joins `rows` requests on the device (itself included)."""
        return self.first_token_steps * (step_ms(self.steps, rows) or 0.0)


@dataclass(frozen=True)
class DecodeRule:
    min_gain_ms: float = 20.0
    gain_share: float = 0.35
    hop_ms: float = 10.0
    stale_ms: float = 2000.0
    relief_speed: float = DEFAULT_RELIEF_SPEED
    relief_gain_ms: float = 5.0
    explore_ms: float = 10_000.0
    """A consumer that has dispatched nothing for this long keeps the next request: its own measures
    are only refreshed by what it serves (one that handed on every request on the strength of a
    first-token time learned in a warm-up burst never learned otherwise, live)."""


@dataclass(frozen=True)
class DecodePeer:
    """A peer as the plan reads it: its id, its priority partitions, its beacon's time and decode state."""

    member_id: str
    at_ms: float
    partitions: tuple[int, ...]
    state: DecodeState


def step_ms(steps: Sequence[tuple[int, float]], rows: float) -> float | None:
    """The decode step at `rows` read off a curve (None when nothing is measured)."""
    return interpolate(list(steps), max(1.0, rows))


def expected_tokens(limit: int, typical: int) -> int:
    """What a request of max_new_tokens `limit` is expected to generate: the typical answer, never more
    than its limit; its limit before any answer."""
    return min(limit, typical) if typical > 0 else limit


def local_wait_ms(position: int, local: DecodeLocal) -> float:
    """How long the request at `position` of the dispatch-ordered queue waits for room here: at once
    within the free slots, else until the running request that frees its slot ends."""
    k = position - local.room
    if k < 0:
        return 0.0
    ends = local.ends_ms
    if k < len(ends):
        return ends[k]
    last = ends[-1] if ends else 0.0
    return last + (k - len(ends) + 1) * local.slot_every_ms


def local_rows(position: int, local: DecodeLocal) -> int:
    """Requests on the device while the request at `position` decodes: those running, the queue ahead
    of it and itself, never more than the slots."""
    return max(1, min(local.running + position + 1, local.running + local.room))


@dataclass(frozen=True)
class Placement:
    """What one more request costs where it would run, from now."""

    first_ms: float
    """Its first token."""
    last_ms: float
    """Its last token."""
    added_ms: float
    """The delay it adds to the requests it would decode beside (`added_delay_ms`)."""

    @property
    def answer_ms(self) -> float:
        """Its answer and what it costs the others: the figure two places are compared by."""
        return self.last_ms + self.added_ms


def row_growth_ms(steps: Sequence[tuple[int, float]], rows: int) -> float:
    """How much a step grows per row around `rows`: the chord of the curve from one row to `rows` (at
    least two). Neighbouring points of a learned curve differ by noise, not by a row's cost; the
    chord is steadier and, the curve being concave, errs on the side of a row costing more."""
    top = max(2, rows)
    one, there = step_ms(steps, 1), step_ms(steps, top)
    if one is None or there is None:
        return 0.0
    return max(0.0, (there - one) / (top - 1))


def added_delay_ms(steps: Sequence[tuple[int, float]], others: int, tokens_left: float) -> float:
    """The delay one more row adds to `others` rows decoding beside it: each of their later steps grows
    by a row's share (`row_growth_ms`), for about `tokens_left` more tokens each. Without it, a
    consumer whose step barely grows with one more row looked free to every peer until its step had
    grown as long as theirs (live, a slow member handed a fast one 15 of 19 requests and the fast
    one's time per output token rose to the slow one's)."""
    if others <= 0:
        return 0.0
    return others * row_growth_ms(steps, others + 1) * tokens_left


def local_placement(position: int, tokens: int, local: DecodeLocal) -> Placement:
    """The request at `position` of the queue, `tokens` long, if it stays."""
    rows = local_rows(position, local)
    first = local_wait_ms(position, local) + local.first_token_ms(rows)
    last = first + (tokens - 1) * (step_ms(local.steps, rows) or 0.0)
    return Placement(first, last, added_delay_ms(local.steps, rows - 1, local.typical_tokens / 2))


def peer_placement(
    peer: DecodeState, extra: int, tokens: int, rule: DecodeRule, age_ms: float, typical: int
) -> Placement:
    """One more request `tokens` long handed to `peer`, after `extra` already sent since its beacon,
    `age_ms` old (`typical`: what an answer runs, as the forwarder knows it). A peer that has not
    learned its decode loop yet (no steps in its beacon) is never chosen: it learns from its own
    partitions' requests."""
    if not peer.steps or peer.first_token_ms <= 0:
        return Placement(math.inf, math.inf, 0.0)
    if peer.room:  # room for `room` more at once; past them, a slot each time a running request ends
        wait = 0.0 if extra < peer.room else (extra - peer.room + 1) * peer.slot_every_ms
    else:  # full: the next end, aged with the beacon, then one end per request sent since
        wait = max(0.0, peer.start_in_ms - age_ms) + extra * peer.slot_every_ms
    rows = max(1, min(peer.running + extra + 1, peer.running + max(peer.room, 1)))
    now_step, then_step = step_ms(peer.steps, peer.running + 1), step_ms(peer.steps, rows)
    scale = then_step / now_step if now_step and then_step else 1.0  # its first token, at the rows it would join
    first = rule.hop_ms + wait + peer.first_token_ms * scale
    last = first + (tokens - 1) * (step_ms(peer.steps, rows) or 0.0)
    return Placement(first, last, added_delay_ms(peer.steps, rows - 1, typical / 2))


def faster(peer: DecodeState, local: DecodeLocal, rule: DecodeRule) -> bool:
    """The peer's decode step is clearly shorter than the local one: the median, over the rows of the
    local curve within the peer's, of their ratio is at most `relief_speed` (a faster device, not the
    noise of one point)."""
    if not peer.steps or not local.steps:
        return False
    top = peer.steps[-1][0]
    ratios = sorted((step_ms(peer.steps, rows) or 0.0) / ms for rows, ms in local.steps if rows <= top and ms > 0) or [
        (step_ms(peer.steps, 1) or 0.0) / (step_ms(local.steps, 1) or math.inf)
    ]
    return ratios[len(ratios) // 2] <= rule.relief_speed


def plan_decode_forwards(
    limits: Sequence[int],
    movable: Sequence[bool],
    local: DecodeLocal,
    peers: Sequence[DecodePeer],
    now_ms: float,
    rule: DecodeRule,
    sent: dict[str, int] | None = None,
) -> list[Forward]:
    """Which waiting requests (dispatch order; `limits[i]`: the max_new_tokens of the request at i)
    go to which peer, back of the queue first; `movable[i]` says whether it may leave (not a forward
    itself). Pass `peers` in `peers_after` order (ties go to the first). `sent` counts requests
    already handed to each peer since its beacon and is updated in place. The scan stops at the
    first movable request that no peer beats: those ahead of it start sooner here still."""
    sent = {} if sent is None else sent
    usable = [p for p in peers if p.partitions and now_ms - p.at_ms <= rule.stale_ms]
    if not usable or not limits or not local.steps or local.first_token_steps <= 0:
        return []
    if local.running == 0 and local.idle_ms >= rule.explore_ms:
        return []
    chosen: list[Forward] = []
    for position in range(len(limits) - 1, -1, -1):
        if not movable[position]:
            continue
        tokens = expected_tokens(limits[position], local.typical_tokens)

        def there(p: DecodePeer, tokens: int = tokens) -> Placement:
            return peer_placement(
                p.state, sent.get(p.member_id, 0), tokens, rule, now_ms - p.at_ms, local.typical_tokens
            )

        best = min(usable, key=lambda p: (there(p).first_ms, there(p).answer_ms))
        theirs, ours = there(best), local_placement(position, tokens, local)
        gain_first, gain_answer = ours.first_ms - theirs.first_ms, ours.answer_ms - theirs.answer_ms
        if faster(best.state, local, rule):  # a clearly faster device: an earlier first token or answer
            margin = rule.relief_gain_ms
            clearly = (gain_first >= margin and gain_answer >= 0) or (
                gain_answer >= margin and gain_first >= -rule.hop_ms
            )
        else:  # twins: only a request that would wait for room here, and then clearly
            margin = max(rule.min_gain_ms, rule.gain_share * ours.first_ms)
            waits = local_wait_ms(position, local) > 0
            clearly = waits and gain_first >= margin and gain_answer >= 0
        if not clearly:
            break
        count = sent.get(best.member_id, 0)
        chosen.append(Forward(position, best.member_id, best.partitions[count % len(best.partitions)]))
        sent[best.member_id] = count + 1
    return chosen


@dataclass
class _OnDevice:
    dispatched_ms: float
    tokens: int
    """Its max_new_tokens."""
    area_at_dispatch: float
    rows: int
    """Requests on the device once it joined (itself included)."""
    steps_at_dispatch: int = 0
    step_ms_at_dispatch: float = 0.0
    """Timed plain steps and their total time before it joined: those of its life are the difference."""


class DecodeLedger:
    """A generating consumer's own measures of its decode loop, from its dispatches and answers.

    `slots`: how many requests its device holds (running and joining). Times are passed in.
    """

    def __init__(self, slots: int, curve_cap: int | None = None) -> None:
        self.slots = max(1, slots)
        self._curve = CostCurve(curve_cap or self.slots, 0.1, None, enabled=False)
        self._on_device: dict[str, _OnDevice] = {}
        self._learned = 0
        """Answers that gave a point of the step curve."""
        self._pace = 1.0
        """The recent answers' time per output token over what the curve expected of them (a moving
        average): the curve's medians follow a device that slowed down within a dozen answers or
        so, this within a few; the steps a beacon carries are the curve times the pace."""
        self._first_token: deque[float] = deque(maxlen=SAMPLES)
        """Dispatch to first token of recent answers, in their own decode steps."""
        self._last_dispatch_ms = -math.inf
        self._answers: deque[int] = deque(maxlen=SAMPLES)
        self._area = 0.0
        """Time integral of the requests on the device (request x ms), up to `_area_ms`."""
        self._area_ms: float | None = None
        self._timed = StepPace()
        """The plain decode steps timed as they run (`stepped`)."""
        self._timed_total_ms = 0.0
        self._over_plain: deque[float] = deque(maxlen=SAMPLES)
        """Recent answers' time per output token over the mean plain step timed during their life."""

    def _advance(self, now_ms: float) -> None:
        if self._area_ms is not None and now_ms > self._area_ms:
            self._area += len(self._on_device) * (now_ms - self._area_ms)
        if self._area_ms is None or now_ms > self._area_ms:
            self._area_ms = now_ms

    def dispatched(self, request_id: str, now_ms: float, max_new_tokens: int) -> None:
        """A request went to the device (it joins the running set there)."""
        self._advance(now_ms)
        self._on_device[request_id] = _OnDevice(
            now_ms, max(1, max_new_tokens), self._area, self.running + 1, self._timed.steps, self._timed_total_ms
        )
        self._last_dispatch_ms = max(self._last_dispatch_ms, now_ms)

    def stepped(self, rows: int, ms: float) -> None:
        """A plain decode step of `rows` rows took `ms` (timed where the loop runs, as it ran)."""
        if rows >= 1 and ms > 0:
            self._timed.stepped(rows, ms)
            self._timed_total_ms += ms

    def left(self, request_id: str, now_ms: float) -> None:
        """It left the device without an answer to learn from (failed, withdrawn)."""
        self._advance(now_ms)
        self._on_device.pop(request_id, None)

    def answered(
        self, request_id: str, now_ms: float, first_token_ms: float | None, last_token_ms: float | None, tokens: int
    ) -> None:
        """It ended with `tokens` generated, its first and last token at those epoch ms: the first-token
        time, the answer length and one point of the step curve (time per output token at the mean
        number of requests on the device over its life)."""
        self._advance(now_ms)
        seen = self._on_device.pop(request_id, None)
        if seen is None or first_token_ms is None:
            return
        self._answers.append(tokens)
        waited = max(0.0, first_token_ms - seen.dispatched_ms)
        if last_token_ms is None or tokens < 2 or last_token_ms <= first_token_ms:
            step = (self._curve.estimate_ms(seen.rows) or 0.0) * self._pace
            if step > 0:
                self._first_token.append(waited / step)
            return
        life = now_ms - seen.dispatched_ms
        rows = (self._area - seen.area_at_dispatch) / life if life > 0 else 1.0
        size, per_token = max(1, round(rows)), (last_token_ms - first_token_ms) / (tokens - 1)
        self._first_token.append(waited / per_token)
        timed = self._timed.steps - seen.steps_at_dispatch
        if timed >= MIN_TIMED:
            self._over_plain.append(per_token * timed / (self._timed_total_ms - seen.step_ms_at_dispatch))
        expected = self._curve.estimate_ms(size)
        if expected and self._learned >= LEARN_AFTER:
            ratio = min(PACE_BOUNDS[1], max(PACE_BOUNDS[0], per_token / expected))
            self._pace += PACE_WEIGHT * (ratio - self._pace)
        self._curve.observe(size, per_token)
        self._learned += 1

    @property
    def running(self) -> int:
        return len(self._on_device)

    @property
    def timed(self) -> bool:
        """Whether the step curve comes from the timed steps (enough of them, and of answers that ran
        among them), not from the answers alone."""
        return self._timed.learned and len(self._over_plain) >= LEARN_AFTER

    def steps(self) -> tuple[tuple[int, float], ...]:
        """The step curve, at most STEP_POINTS points (the largest rows always among them): the timed
        steps' at their recent pace times the answers' ratio to them, else the answers' curve at
        their pace; empty before LEARN_AFTER answers."""
        if self._learned < LEARN_AFTER:
            return ()
        if self.timed:
            ratio = _median(self._over_plain)
            points = [(rows, ms * ratio) for rows, ms in self._timed.points()]
        else:
            points = [(rows, ms * self._pace) for rows, ms in self._curve.points()]
        if len(points) > STEP_POINTS:
            stride = (len(points) - 1) / (STEP_POINTS - 1)
            points = [points[round(k * stride)] for k in range(STEP_POINTS)]
        return tuple((int(rows), float(ms)) for rows, ms in points)

    def first_token_steps(self) -> float:
        """Dispatch to first token in decode steps, the median of recent answers (each in its own time
        per output token; 0 before LEARN_AFTER): a joiner waits for its group and rides the steps in
        chunks, so its first token takes a few steps, and as long as the steps are. A first-token time
        in ms would carry the state it was learned in: one learned while a warm-up burst queued twenty
        joiners, read on an idle loop, made a consumer hand on every request it got."""
        if len(self._first_token) < LEARN_AFTER or self._learned < LEARN_AFTER:
            return 0.0
        return _median(self._first_token)

    def first_token_ms(self, rows: int | None = None) -> float:
        """Dispatch to first token of a request joining `rows` requests (default: one more than now)."""
        steps = self.steps()
        return self.first_token_steps() * (step_ms(steps, self.running + 1 if rows is None else rows) or 0.0)

    def typical_tokens(self) -> int:
        return int(_median(self._answers))

    def local(self, now_ms: float, room: int) -> DecodeLocal:
        """This consumer's decode loop now, with `room` free device slots."""
        steps = self.steps()
        first_steps = self.first_token_steps()
        typical = self.typical_tokens()
        rows = max(1, self.running)
        step = step_ms(steps, rows) or 0.0
        first = first_steps * step
        ends = sorted(
            max(step, d.dispatched_ms + first + (expected_tokens(d.tokens, typical) - 1) * step - now_ms)
            for d in self._on_device.values()
        )
        life = first + max(0, typical - 1) * step
        idle = now_ms - self._last_dispatch_ms
        return DecodeLocal(tuple(ends), first_steps, steps, max(0, room), life / rows, typical, idle)

    def state(self, now_ms: float, room: int, waiting: int) -> DecodeState:
        """What its beacon says with `room` free slots and `waiting` requests queued ahead of one more."""
        local = self.local(now_ms, room)
        return DecodeState(
            start_in_ms=local_wait_ms(waiting, local),
            first_token_ms=local.first_token_ms(local_rows(waiting, local)),
            steps=local.steps,
            running=local.running,
            room=max(0, local.room - waiting),
            slot_every_ms=local.slot_every_ms,
        )


def _median(values: Sequence[float] | deque[float] | deque[int]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2])
