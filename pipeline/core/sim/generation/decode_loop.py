"""Discrete-event simulation of iteration-level generation: a batching policy feeding a decode loop.

The request simulator (simulator.py) runs each batch alone for t(b); a generating model served
with `batching = "iteration"` does not: the engine dispatches batches (about one request each)
while up to `max_inflight_batches` are in flight, their rows queue as joiners, and one decode
loop owns the device. At every iteration the loop drops joiners past their deadline, refuses
the hopeless ones and admits a group of joiners (`JoinRule`, the consumer's own rule:
pipeline/core/engine/joins.py, shared with consumers/runners/iteration.py), stops rows past
their deadline, prefills the admitted groups (in one piece, or in chunks riding the decode
steps: chunks.py), then decodes one token for every row. A row leaves when it has its
tokens; a batch completes (the policy learns its time) when its last row left. Time per step
depends on the rows in the cache and its length (`GenerationCost`), so joins, leaves, long
prompts and memory all show in the times, as on the device.

Pure: no clock, no asyncio; virtual milliseconds in, per-request stamps out.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from pipeline.core.engine.decisions import Batch, BatchPolicy, PendingRequest
from pipeline.core.engine.joins import (
    JOIN_GROUP,
    JOIN_WAIT_STEPS,
    MIN_CHUNK,
    OLDEST_SHARE,
    RIDE_WINDOW,
    Decoding,
    Joiner,
    JoinRule,
    JoinSettings,
    LoopView,
    RideCredit,
    Waiting,
    late_for_first_token,
    length_groups,
    paced_ride,
    ride_allowance,
    ride_plan,
    ride_tokens,
    rides_late,
    rides_ms,
    stall_room,
)
from pipeline.core.sim.generation.chunks import ChunkedGroup, chunk_tokens, ride_ms, ride_token_ms
from pipeline.core.sim.generation.cost import GenerationCost

JOIN_SLOTS = 2 * JOIN_GROUP
"""In-flight batches beyond what the running set holds (the consumer's value)."""
DEAD_SHARE = 0.125
"""Finished rows stay in the cache until this share of its rows are finished (the consumer's value)."""
STEP_TOKEN_BUDGET = 128
"""The consumer's default step_token_budget (pipeline/core/config.py)."""

_ARRIVE, _WAKE, _PREFILLED, _STEPPED = 0, 1, 2, 3


@dataclass(frozen=True)
class GenArrivals:
    """Generation requests in delivery order (parallel arrays)."""

    create_ms: np.ndarray
    deliver_ms: np.ndarray
    prompt: np.ndarray
    """Prompt tokens."""
    emits: np.ndarray
    """Tokens the model emits before the row ends (the prefill's first token included): the
    answer's tokens, plus one when it ended on an end-of-sequence token."""
    limit: np.ndarray
    """max_new_tokens of the request (what it may generate, and reserves in the KV cap)."""
    priority: np.ndarray
    lane: np.ndarray
    deadline_ms: np.ndarray
    """Absolute deadline, NaN for none."""
    exact_answers: bool = False
    """Every answer runs to its limit (a replayed trace's, the end-of-sequence ignored): the loop
    knows how many tokens a row has left."""

    def __len__(self) -> int:
        return int(self.create_ms.shape[0])

    def cost(self, i: int) -> int:
        """Size of request i in the engine's `tokens` unit: prompt + what it may generate."""
        return int(self.prompt[i] + self.limit[i])


@dataclass(frozen=True)
class LoopSettings:
    """The decode loop's bounds, as the consumer derives them from its profile."""

    token_cap: int | None = None
    """KV tokens the running set may reserve (prompt + max_new_tokens per row); None: unbounded."""
    step_budget_ms: float | None = None
    """While the last step took longer, a short queue does not join."""
    reserve_tokens: int = 0
    """Generation tokens reserved per row at least (the model's max_new_tokens)."""
    join_group: int = JOIN_GROUP
    join_wait_steps: int = JOIN_WAIT_STEPS
    tpot_ms: float | None = None
    """The model's slo_ms_per_new_token (None: rides add RIDE_SHARE of a step)."""
    step_token_budget: int = STEP_TOKEN_BUDGET
    refuse_hopeless: bool = True
    ttft_ms: float | None = None
    """The time-to-first-token objective: a waiting request that cannot meet it is answered expired at
    once (joins.late_for_first_token; the model's slo_p99_ms with `shed_when = "slo"`); None: never."""

    def join_settings(self) -> JoinSettings:
        return JoinSettings(
            self.token_cap,
            self.step_budget_ms,
            self.join_group,
            self.join_wait_steps,
            self.tpot_ms,
            self.step_token_budget,
            self.refuse_hopeless,
        )


def running_token_cap(batch_cap: int | None, slots: int, target: int | None = None) -> int | None:
    """The running set's token cap for a batch cap, in-flight slots and target (the consumer's rule)."""
    if batch_cap is None:
        return None
    return max(batch_cap, (target or batch_cap) * max(1, slots - JOIN_SLOTS))


@dataclass(eq=False)
class _InFlightBatch:
    batch: Batch
    dispatch_ms: float
    arrived_step: int
    remaining: int


@dataclass(eq=False)
class _Row:
    i: int
    group: _InFlightBatch
    reserved: int
    emitted: int = 0
    done: bool = False
    last_ms: float = 0.0


@dataclass
class _Loop:
    """One device's decode loop."""

    rule: JoinRule
    joiners: deque[_Row] = field(default_factory=deque)
    live: list[_Row] = field(default_factory=list)
    prefills: deque[ChunkedGroup[_Row]] = field(default_factory=deque)
    """Groups prefilled in chunks riding the steps (the head advances)."""
    dead: int = 0
    """Finished rows still in the cache."""
    size_at_join: int = 0
    steps: int = 0
    joins: int = 0
    last_step_ms: float = 0.0
    busy: bool = False
    inflight: int = 0
    credit: RideCredit = field(default_factory=RideCredit)
    """Rides wait while what they added is paid back (the consumer's pacer)."""
    rides: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=RIDE_WINDOW))
    """The recent rides, (tokens, ms added) each: they bound the next one's size (joins.vouched_ride)."""

    @property
    def reserved(self) -> int:
        return sum(r.reserved for r in self.live) + sum(p.reserved for p in self.prefills)

    def view(self) -> LoopView:
        return LoopView(len(self.live), self.reserved, self.last_step_ms, self.steps, self.size_at_join)


@dataclass
class GenOutcome:
    """Per-request stamps (NaN where none), indexed like the arrivals."""

    arrivals: GenArrivals
    dispatch_ms: np.ndarray
    first_ms: np.ndarray
    done_ms: np.ndarray
    expired: np.ndarray
    batch_sizes: list[int]
    steps: int
    joins: int
    step_rows: list[int]
    """Rows decoded at each step (for the mean running set)."""
    longest_gap_ms: float = 0.0
    """The longest time between two tokens of one answer (a prefill that stalled the set shows here)."""


def simulate_generation(
    arrivals: GenArrivals,
    cost: GenerationCost,
    policies: Sequence[BatchPolicy],
    settings: LoopSettings,
    max_inflight: int,
) -> GenOutcome:
    """Run every request to its answer (served, expired or refused). One policy and one decode loop per lane."""
    arr = arrivals
    n = len(arr)
    lanes = len(policies)
    loops = [_Loop(JoinRule(settings.join_settings())) for _ in range(lanes)]
    budget = settings.step_token_budget
    disp = np.full(n, np.nan)
    first = np.full(n, np.nan)
    done = np.full(n, np.nan)
    expired = np.zeros(n, dtype=bool)
    sizes: list[int] = []
    step_rows: list[int] = []
    heap: list[tuple[float, int, int, int, object]] = []
    seq = 0
    wake_version = [0] * lanes
    answered = 0
    gap = [0.0]
    deadline = arr.deadline_ms
    exact = arr.exact_answers
    due = bool(np.isfinite(deadline).any())
    """Whether any request has a deadline (without, the scans for the expired are skipped)."""

    def push(t: float, kind: int, lane: int, data: object = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, lane, data))

    def finish_row(lane: int, row: _Row, now: float, was_expired: bool) -> None:
        nonlocal answered
        row.done = True
        done[row.i] = now
        expired[row.i] = was_expired
        answered += 1
        if not was_expired:
            loops[lane].rule.learn(row.emitted)
        group = row.group
        group.remaining -= 1
        if group.remaining == 0:
            loops[lane].inflight -= 1
            policies[lane].completed(group.batch, now, now - group.dispatch_ms)

    def poll(lane: int, now: float) -> None:
        nonlocal answered
        policy, loop = policies[lane], loops[lane]
        while True:
            decision = policy.poll(now, loop.inflight < max_inflight, 0)
            for req in decision.expired:
                done[req.payload] = now
                expired[req.payload] = True
                answered += 1
            batch = decision.batch
            if batch is None:
                if decision.wake_at_ms is not None:
                    wake_version[lane] += 1
                    push(max(decision.wake_at_ms, now + 0.001), _WAKE, lane, wake_version[lane])
                break
            loop.inflight += 1
            sizes.append(len(batch.requests))
            group = _InFlightBatch(batch, now, loop.steps, len(batch.requests))
            for req in batch.requests:
                i = req.payload
                disp[i] = now
                loop.joiners.append(_Row(i, group, int(arr.prompt[i] + max(arr.limit[i], settings.reserve_tokens))))
        if not loop.busy and loop.joiners:
            iterate(lane, now)

    def compact(loop: _Loop) -> None:
        total = loop.dead + len(loop.live)
        if loop.dead and (not loop.live or loop.dead >= DEAD_SHARE * total):
            loop.dead = 0

    def joiner(row: _Row) -> Joiner:
        i = row.i
        d = deadline[i]
        return Joiner(
            int(arr.prompt[i]),
            row.reserved,
            int(arr.limit[i]),
            None if np.isnan(d) else float(d),
            int(arr.priority[i]),
            row.group.arrived_step,
        )

    def plain_step(lane: int) -> tuple[int, float]:
        """(rows in the cache, ms) of the running rows' next plain decode step."""
        loop = loops[lane]
        rows = len(loop.live) + loop.dead
        return rows, cost.step_ms(rows, max(int(arr.prompt[r.i]) + r.emitted for r in loop.live))

    def ride_size(lane: int, ms: float) -> int:
        """Prompt tokens the next ride carries beside a plain step of `ms` (the consumer's pacer)."""
        decoding = len(loops[lane].live)
        per_token = cost.ride_token_ms()
        if per_token:  # the consumer's pacer, once it has fitted both parts
            return paced_ride(budget, decoding, ms, per_token, settings.tpot_ms, cost.ride_fixed(), loops[lane].rides)
        device = ms - cost.step_overhead_ms
        return ride_tokens(
            chunk_tokens(budget, decoding), ms, ride_token_ms(device, budget, decoding), settings.tpot_ms
        )

    def ride_added(lane: int, ms: float, fed: int) -> float:
        """What a ride of `fed` prompt tokens adds to a plain step of `ms`."""
        per_token = cost.ride_token_ms()
        if per_token:
            return cost.ride_fixed() + fed * per_token
        device = ms - cost.step_overhead_ms  # a ride adds to the forward pass, not to the loop's fixed cost
        return ride_ms(device, fed / chunk_tokens(budget, len(loops[lane].live))) - device

    def step(lane: int, now: float) -> None:
        """One decode step of the running rows; the queued groups' next chunks ride it (joins.ride_plan) when
        the last rides are paid back (joins.RideCredit)."""
        loop = loops[lane]
        rows, ms = plain_step(lane)
        merged: list[_Row] = []
        allowance = ride_allowance(ms, settings.tpot_ms)
        if not loop.prefills or not loop.credit.due(allowance):
            loop.credit.plain(allowance)
        else:
            queue: list[ChunkedGroup[_Row]] = list(loop.prefills)
            fed = 0
            for k, chunk in ride_plan([p.rest_tokens() for p in queue], ride_size(lane, ms)):
                group = queue[k]
                fed += group.ride(chunk)
                if group.complete:
                    loop.prefills.remove(group)
                    merged += group.rows
            added = ride_added(lane, ms, fed)
            loop.credit.rode(added, allowance)
            if fed > 0:
                loop.rides.append((fed, added))
            ms += added
        step_rows.append(rows)
        loop.busy = True
        push(now + ms, _STEPPED, lane, (ms, merged))

    def late_for_ttft(lane: int, waiting: list[_Row], now: float) -> list[_Row]:
        """Answer `expired` the queued prompts and joiners (in the order the loop serves them) whose first
        token cannot meet the objective (joins.late_for_first_token); returns the joiners still waiting."""
        loop = loops[lane]
        assert settings.ttft_ms is not None
        queued = list(loop.prefills)
        order = sorted(waiting, key=lambda r: int(arr.priority[r.i]))  # the rule admits urgent first
        items = [
            Waiting(min(float(arr.create_ms[r.i]) for r in p.rows) + settings.ttft_ms, p.rest_tokens(), p.done > 0)
            for p in queued
        ] + [Waiting(float(arr.create_ms[r.i]) + settings.ttft_ms, int(arr.prompt[r.i]), False) for r in order]
        for k in late_for_first_token(items, now, cost.prompt_token_ms()):
            if k < len(queued):
                loop.prefills.remove(queued[k])
                for row in queued[k].rows:
                    finish_row(lane, row, now, True)
            else:
                finish_row(lane, order[k - len(queued)], now, True)
        return [r for r in waiting if not r.done]

    def pace(lane: int, share: float) -> tuple[int, float]:
        """(tokens, ms) a queued prompt gets per ride at the rides' pace: its `share` of a ride, and the
        time from one ride to the next (its step and the plain steps that pay it back)."""
        _, ms = plain_step(lane)
        tokens = ride_size(lane, ms)
        added = ride_added(lane, ms, tokens)
        allowance = ride_allowance(ms, settings.tpot_ms)
        per_ride = ms * max(1.0, added / allowance) + added if allowance > 0 else ms + added
        return max(MIN_CHUNK, int(share * tokens)), per_ride

    def late_on_rides(lane: int, head: ChunkedGroup[_Row], now: float, by: float) -> bool:
        """Whether the oldest queued prompt, riding at the rides' pace (its share of each), would get its
        first token past `by` (joins.rides_late)."""
        share = OLDEST_SHARE if len(loops[lane].prefills) > 1 else 1.0
        return rides_late(head.rest_tokens(), *pace(lane, share), now, by)

    def room_now(lane: int, now: float) -> tuple[float, float]:
        """The running rows' room for a stall (joins.stall_room), less what the rides owe."""
        loop = loops[lane]
        if settings.tpot_ms is None or not loop.live:
            return 0.0, 0.0
        rule = loop.rule
        rows = [
            Decoding(float(first[r.i]), r.emitted, rule.remaining_tokens(r.emitted, int(arr.limit[r.i]), exact))
            for r in loop.live
        ]
        width = max(int(arr.prompt[r.i]) + r.emitted for r in loop.live)
        room, banked = stall_room(rows, now, cost.step_ms(len(loop.live) + loop.dead, width), settings.tpot_ms)
        return room - loop.credit.owed_ms, banked

    def iterate(lane: int, now: float) -> None:
        """One pass of the decode loop from `now`: drop, refuse, admit, expire, prefill or step (or idle)."""
        loop = loops[lane]
        rule = loop.rule
        for row in [r for r in loop.joiners if due and not np.isnan(deadline[r.i]) and deadline[r.i] <= now]:
            finish_row(lane, row, now, True)
        waiting = [r for r in loop.joiners if not r.done]
        view = loop.view()
        for k in rule.refused([joiner(r) for r in waiting], view, now):
            finish_row(lane, waiting[k], now, True)
        waiting = [r for r in waiting if not r.done]
        if settings.ttft_ms is not None:
            waiting = late_for_ttft(lane, waiting, now)
        chosen = rule.admit([joiner(r) for r in waiting], view, now)
        joining = [waiting[k] for k in chosen]
        taken = set(map(id, joining))
        loop.joiners = deque(r for r in waiting if id(r) not in taken)
        for row in [r for r in loop.live if due and not np.isnan(deadline[r.i]) and deadline[r.i] <= now]:
            finish_row(lane, row, now, True)
            loop.dead += 1
        loop.live = [r for r in loop.live if not r.done]
        for p in [p for p in loop.prefills if due and all(deadline[r.i] <= now for r in p.rows)]:
            loop.prefills.remove(p)
            for row in p.rows:
                finish_row(lane, row, now, True)
        compact(loop)
        whole: list[_Row] = []
        ms = 0.0
        if joining:
            loop.joins += 1
            room, banked = room_now(lane, now)
            riding = pace(lane, 1.0) if room > 0 else (1, 0.0)
            for group in length_groups([int(arr.prompt[r.i]) for r in joining]):
                rows = [joining[k] for k in group]
                width = max(int(arr.prompt[r.i]) for r in rows)
                stall = cost.prefill_ms(len(rows), width)
                slow = rides_ms(sum(int(arr.prompt[r.i]) for r in rows), *riding)
                if rule.one_piece(len(loop.live)) or rule.stall_fits(ms + stall, room, len(loop.prefills), slow):
                    ms += stall
                    whole += rows
                else:
                    loop.prefills.extend(ChunkedGroup([r], int(arr.prompt[r.i])) for r in rows)  # rides: unpadded
            if whole and loop.live:
                loop.credit.stalled(ms, banked)
        if not whole and loop.live and loop.prefills and settings.ttft_ms is not None:
            head = loop.prefills[0]
            by = min(float(arr.create_ms[r.i]) for r in head.rows) + settings.ttft_ms
            if late_on_rides(lane, head, now, by):
                stall = cost.prefill_ms(1, head.rest_tokens())
                room, banked = room_now(lane, now)
                if rule.rescue(stall, room, now, by):
                    loop.prefills.popleft()
                    ms, whole = stall, head.rows
                    loop.credit.stalled(stall, banked)
        if not whole and not loop.live and loop.prefills:
            head = loop.prefills.popleft()
            ms = cost.prefill_ms(1, head.rest_tokens())
            whole = head.rows
        if whole:
            loop.busy = True
            push(now + ms, _PREFILLED, lane, whole)
        elif loop.live:
            step(lane, now)
        elif loop.joiners:
            iterate(lane, now)  # the rows that kept them waiting expired: the loop goes round again
        else:
            loop.busy = False

    def emitted(lane: int, rows: list[_Row], now: float) -> None:
        """Each row got one token at `now`; those with all theirs leave."""
        loop = loops[lane]
        for row in rows:
            if row.emitted:
                gap[0] = max(gap[0], now - row.last_ms)
            row.last_ms = now
            row.emitted += 1
            if row.emitted >= arr.emits[row.i] or row.emitted >= arr.limit[row.i]:
                finish_row(lane, row, now, False)
                loop.dead += 1
        loop.live = [r for r in loop.live if not r.done]
        compact(loop)

    def merge(lane: int, joining: list[_Row], now: float) -> None:
        loop = loops[lane]
        reuse = min(loop.dead, len(joining))
        loop.dead -= reuse
        loop.live.extend(joining)
        loop.size_at_join = len(loop.live)
        for row in joining:
            first[row.i] = now
        emitted(lane, joining, now)

    i = 0
    inf = float("inf")
    deliver = arr.deliver_ms
    while answered < n:
        t_arr = float(deliver[i]) if i < n else inf
        if heap and heap[0][0] <= t_arr:
            now, _, kind, lane, data = heapq.heappop(heap)
            loop = loops[lane]
            if kind == _WAKE:
                if data == wake_version[lane]:
                    poll(lane, now)
            elif kind == _PREFILLED:
                merge(lane, cast(list[_Row], data), now)
                poll(lane, now)
                if loop.live:
                    step(lane, now)
                else:
                    iterate(lane, now)
            else:
                ms, merged = cast(tuple[float, list[_Row]], data)
                loop.steps += 1
                loop.last_step_ms = float(ms)
                emitted(lane, list(loop.live), now)
                if merged:
                    merge(lane, merged, now)
                poll(lane, now)
                iterate(lane, now)
            continue
        if i >= n:
            raise RuntimeError(f"{n - answered} generation requests were never answered")
        now = t_arr
        lane = int(arr.lane[i])
        d = deadline[i]
        policies[lane].offer(
            PendingRequest(
                str(i), float(arr.create_ms[i]), arr.cost(i), int(arr.priority[i]), None if np.isnan(d) else float(d), i
            ),
            now,
        )
        i += 1
        poll(lane, now)
    return GenOutcome(
        arr,
        disp,
        first,
        done,
        expired,
        sizes,
        sum(lp.steps for lp in loops),
        sum(lp.joins for lp in loops),
        step_rows,
        gap[0],
    )
