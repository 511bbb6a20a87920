"""Discrete-event simulation of iteration-level generation: a batching policy feeding a decode loop.

The request simulator (simulator.py) runs each batch alone for t(b); a generating model served
with `batching = "iteration"` does not: the engine dispatches batches (about one request each)
while up to `max_inflight_batches` are in flight, their rows queue as joiners, and one decode
loop owns the device. At every iteration the loop drops joiners past their deadline, admits a
group of joiners (`JoinRule`, the consumer's rule: consumers/runners/iteration.py), stops rows
past their deadline, prefills the group, then decodes one token for every row. A row leaves
when it has its tokens; a batch completes (the policy learns its time) when its last row left.
Time per step depends on the rows in the cache and its length (`GenerationCost`), so joins,
leaves, long prompts and memory all show in the times, as on the device.

Pure: no clock, no asyncio; virtual milliseconds in, per-request stamps out.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipeline.core.engine.decisions import Batch, BatchPolicy, PendingRequest
from pipeline.core.sim.gencost import GenerationCost

JOIN_GROUP = 4
"""Joiners that make a join worth its prefill at once (the consumer's value)."""
JOIN_WAIT_STEPS = 6
"""Decode steps the oldest joiner may wait for company (the consumer's value)."""
JOIN_SLOTS = 2 * JOIN_GROUP
"""In-flight batches beyond what the running set holds (the consumer's value)."""
DEAD_SHARE = 0.125
"""Finished rows stay in the cache until this share of its rows are finished (the consumer's value)."""

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


def running_token_cap(batch_cap: int | None, slots: int, target: int | None = None) -> int | None:
    """The running set's token cap for a batch cap, in-flight slots and target (the consumer's rule)."""
    if batch_cap is None:
        return None
    return max(batch_cap, (target or batch_cap) * max(1, slots - JOIN_SLOTS))


@dataclass(eq=False)
class _Group:
    batch: Batch
    dispatch_ms: float
    arrived_step: int
    remaining: int


@dataclass(eq=False)
class _Row:
    i: int
    group: _Group
    reserved: int
    emitted: int = 0
    done: bool = False
    last_ms: float = 0.0


@dataclass
class _Loop:
    """One device's decode loop."""

    joiners: deque = field(default_factory=deque)
    live: list = field(default_factory=list)
    dead: int = 0
    """Finished rows still in the cache."""
    size_at_join: int = 0
    steps: int = 0
    joins: int = 0
    last_step_ms: float = 0.0
    busy: bool = False
    inflight: int = 0

    @property
    def reserved(self) -> int:
        return sum(r.reserved for r in self.live)


class JoinRule:
    """Which joiners enter the running set before the next step (consumers/runners/iteration.py)."""

    def __init__(self, settings: LoopSettings) -> None:
        self.s = settings

    def hopeless(self, loop: _Loop, row: _Row, arr: GenArrivals, now: float) -> bool:
        deadline = arr.deadline_ms[row.i]
        if np.isnan(deadline) or not loop.live:
            return False
        return now + arr.limit[row.i] * loop.last_step_ms > deadline

    def admit(self, loop: _Loop, arr: GenArrivals, now: float) -> list[_Row]:
        s = self.s
        room = None if s.token_cap is None else s.token_cap - loop.reserved
        fits: list[_Row] = []
        for row in loop.joiners:
            if self.hopeless(loop, row, arr, now):
                continue
            if room is not None:
                if row.reserved > room:
                    if not loop.live and not fits:
                        fits.append(row)  # longer than the cap: the consumer refuses it; here it runs alone
                    break
                room -= row.reserved
            fits.append(row)
        if not fits:
            return []
        over_budget = s.step_budget_ms is not None and loop.last_step_ms > s.step_budget_ms
        if loop.live and over_budget and len(loop.joiners) < s.join_group:
            return []
        pays = (
            not loop.live
            or len(fits) >= s.join_group
            or len(loop.live) * 2 <= loop.size_at_join
            or loop.steps - fits[0].group.arrived_step >= s.join_wait_steps
        )
        if not pays:
            return []
        chosen = set(map(id, fits))
        loop.joiners = deque(r for r in loop.joiners if id(r) not in chosen)
        return fits


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


def simulate_generation(arrivals: GenArrivals, cost: GenerationCost, policies: Sequence[BatchPolicy],
                        settings: LoopSettings, max_inflight: int, rule: JoinRule | None = None) -> GenOutcome:
    """Run every request to its answer (served or expired). One policy and one decode loop per lane."""
    arr = arrivals
    n = len(arr)
    rule = rule or JoinRule(settings)
    lanes = len(policies)
    loops = [_Loop() for _ in range(lanes)]
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
            group = _Group(batch, now, loop.steps, len(batch.requests))
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

    def step(lane: int, now: float) -> None:
        loop = loops[lane]
        rows = len(loop.live) + loop.dead
        width = max(int(arr.prompt[r.i]) + r.emitted for r in loop.live)
        ms = cost.step_ms(rows, width)
        step_rows.append(rows)
        loop.busy = True
        push(now + ms, _STEPPED, lane, ms)

    def iterate(lane: int, now: float) -> None:
        """One pass of the decode loop from `now`: drop, admit, expire, prefill or step (or idle)."""
        loop = loops[lane]
        for row in [r for r in loop.joiners if not np.isnan(arr.deadline_ms[r.i]) and arr.deadline_ms[r.i] <= now]:
            finish_row(lane, row, now, True)
        loop.joiners = deque(r for r in loop.joiners if not r.done)
        joining = rule.admit(loop, arr, now)
        for row in [r for r in loop.live if not np.isnan(arr.deadline_ms[r.i]) and arr.deadline_ms[r.i] <= now]:
            finish_row(lane, row, now, True)
            loop.dead += 1
        loop.live = [r for r in loop.live if not r.done]
        compact(loop)
        if joining:
            loop.joins += 1
            width = max(int(arr.prompt[r.i]) for r in joining)
            loop.busy = True
            push(now + cost.prefill_ms(len(joining), width), _PREFILLED, lane, joining)
        elif loop.live:
            step(lane, now)
        elif loop.joiners:
            iterate(lane, now)  # the rows that made them hopeless expired: the loop goes round again
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
                joining: list[_Row] = data  # type: ignore[assignment]
                reuse = min(loop.dead, len(joining))
                loop.dead -= reuse
                loop.live.extend(joining)
                loop.size_at_join = len(loop.live)
                for row in joining:
                    first[row.i] = now
                emitted(lane, joining, now)
                poll(lane, now)
                if loop.live:
                    step(lane, now)
                else:
                    iterate(lane, now)
            else:
                loop.steps += 1
                loop.last_step_ms = float(data)  # type: ignore[arg-type]
                emitted(lane, list(loop.live), now)
                poll(lane, now)
                iterate(lane, now)
            continue
        if i >= n:
            raise RuntimeError(f"{n - answered} generation requests were never answered")
        now = t_arr
        lane = int(arr.lane[i])
        deadline = arr.deadline_ms[i]
        policies[lane].offer(PendingRequest(str(i), float(arr.create_ms[i]), arr.cost(i), int(arr.priority[i]),
                                            None if np.isnan(deadline) else float(deadline), i), now)
        i += 1
        poll(lane, now)
    return GenOutcome(arr, disp, first, done, expired, sizes, sum(lp.steps for lp in loops),
                      sum(lp.joins for lp in loops), step_rows, gap[0])


@dataclass(frozen=True)
class GenFigures:
    """What a generation run measured (served requests; expired ones are counted apart)."""

    requests: int
    served: int
    p50_ms: float
    p99_ms: float
    throughput_rps: float
    generated_tokens_per_s: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    expired_share: float
    mean_rows: float


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def gen_figures(outcome: GenOutcome, tokens_out: np.ndarray, overhead_ms: float = 0.0) -> GenFigures:
    """End-to-end percentiles (plus `overhead_ms`, the hops outside the device), throughput over the
    first record to the last answer, TTFT and TPOT p99 of the served requests."""
    arr = outcome.arrivals
    served = ~outcome.expired & ~np.isnan(outcome.done_ms)
    e2e = (outcome.done_ms - arr.create_ms)[served] + overhead_ms
    span_s = max(1e-9, (float(np.nanmax(outcome.done_ms)) - float(arr.create_ms.min())) / 1000.0) if len(arr) else 1.0
    ttft = (outcome.first_ms - arr.create_ms)[served]
    many = served & (tokens_out > 1)
    tpot = (outcome.done_ms - outcome.first_ms)[many] / (tokens_out[many] - 1)
    return GenFigures(
        requests=len(arr), served=int(served.sum()),
        p50_ms=_pct(e2e, 50), p99_ms=_pct(e2e, 99),
        throughput_rps=float(served.sum()) / span_s,
        generated_tokens_per_s=float(tokens_out[served].sum()) / span_s,
        ttft_p99_ms=_pct(ttft, 99), tpot_p99_ms=_pct(tpot, 99),
        expired_share=float(outcome.expired.mean()) if len(arr) else 0.0,
        mean_rows=float(np.mean(outcome.step_rows)) if outcome.step_rows else 0.0,
    )
