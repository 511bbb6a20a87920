"""LLM servers' schedulers, re-implemented from their documentation, on the simulated device.

Each is a `TokenScheduler`: before every iteration it says which waiting requests enter the
running set, how many prompt tokens of which rows are prefilled, and whether the rows that
have their prompt decode one token. `simulate_tokens` runs it on the same `GenerationCost`
and arrivals as batchtide's decode loop (decode_loop.py), so a comparison compares schedulers:

- vLLM: `max_num_seqs`, `max_num_batched_tokens` (the tokens of one iteration), chunked
  prefill (decodes first, then prompt chunks in the budget left) or not (a prefill-only
  iteration whenever a waiting request fits), `fcfs` or `priority` order, and KV blocks
  allocated as tokens come, preempting the newest row (recompute) when they run out;
- TGI's router: `max_batch_total_tokens` (prompt + max_new_tokens of every row),
  `max_batch_prefill_tokens`, and a new prefill batch only when
  `waiting_served_ratio x running` requests can join or `max_waiting_tokens` steps passed;
- SGLang: prefill first, `chunked_prefill_size` tokens per prefill iteration, a row admitted
  while the KV cache holds its prompt plus `schedule_conservativeness x` 0.7 of its
  max_new_tokens for every row;
- the field report's fixed window: a static batch of up to `cap` requests once the oldest
  waited `window_ms` (or the cap is reached), decoded until its last row ends.

By default every scheduler is charged the kernels batchtide's runner measured (a prefill pads
its rows; a chunk fused with a decode step costs what the runner's fused chunk costs), so the
comparison is of schedulers on one device; `kernels="ragged"` gives the servers their own
idealised kernels (ragged batches, no padding, a fused chunk costs only its tokens' share of a
prefill). The fixed window pads either way, as a static batch of a transformers model does.

Pure: no clock; deadlines are the client's (a request past it is answered `expired` by
every scheduler alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from pipeline.core.sim.generation.chunks import ride_ms, rides
from pipeline.core.sim.generation.cost import GenerationCost
from pipeline.core.sim.generation.decode_loop import STEP_TOKEN_BUDGET, GenArrivals, GenOutcome

Kernels = Literal["runner", "ragged"]
"""What a peer's iterations cost: the runner's measured kernels, or the servers' own idealised ones."""
KERNELS: tuple[Kernels, ...] = ("runner", "ragged")


@dataclass(eq=False)
class Row:
    i: int
    arrival: float
    prompt: int
    """Tokens to prefill (a preempted row recomputes its prompt and what it generated)."""
    limit: int
    priority: int
    prefilled: int = 0
    emitted: int = 0
    admitted: int = 0
    """Admission order (the newest is preempted first)."""
    last_ms: float = 0.0
    folded: int = 0
    """Generated tokens folded into `prompt` by a preemption (recomputed with it)."""

    @property
    def ready(self) -> bool:
        return self.prefilled >= self.prompt

    @property
    def kv(self) -> int:
        return self.prefilled + self.emitted - self.folded


@dataclass
class Plan:
    admit: list[Row] = field(default_factory=list)
    prefill: list[tuple[Row, int]] = field(default_factory=list)
    decode: bool = False
    wake_at_ms: float | None = None
    """Nothing to run before this time (a window waiting to fill)."""


class TokenScheduler(Protocol):
    name: str

    def plan(self, waiting: list[Row], running: list[Row], now: float) -> Plan: ...


@dataclass
class VLLM:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    chunked: bool = True
    policy: str = "fcfs"
    kv_tokens: int = 1 << 30
    name: str = "vllm"

    def order(self, waiting: list[Row]) -> list[Row]:
        if self.policy == "priority":
            return sorted(waiting, key=lambda r: (r.priority, r.arrival))
        return waiting

    def plan(self, waiting: list[Row], running: list[Row], now: float) -> Plan:
        plan = Plan()
        used = sum(r.kv for r in running) + sum(1 for r in running if r.ready)
        budget = self.max_num_batched_tokens
        seqs = len(running)
        if self.chunked:
            # decodes first (one token each), then the rows part-way through their prompt, then new rows
            decoding = sum(1 for r in running if r.ready)
            plan.decode = decoding > 0
            budget -= decoding
            for r in running:
                if not r.ready and budget > 0:
                    chunk = min(r.prompt - r.prefilled, budget)
                    plan.prefill.append((r, chunk))
                    budget -= chunk
        for r in self.order(waiting):
            if budget <= 0 or seqs >= self.max_num_seqs:
                break
            chunk = min(r.prompt, budget) if self.chunked else r.prompt
            if (chunk > budget and plan.admit) or used + chunk > self.kv_tokens:
                break
            plan.admit.append(r)
            plan.prefill.append((r, chunk))
            budget -= chunk
            used += chunk
            seqs += 1
        if not self.chunked:
            # a prefill-only iteration whenever new rows fit, else a decode step
            plan.decode = not plan.admit and any(r.ready for r in running)
        return plan

    def preempt(self, running: list[Row]) -> Row | None:
        """The newest running row when the next step's tokens do not fit the KV cache."""
        need = sum(r.kv for r in running) + sum(1 for r in running if r.ready)
        if need <= self.kv_tokens or len(running) <= 1:
            return None
        return max(running, key=lambda r: r.admitted)


@dataclass
class TGI:
    max_batch_total_tokens: int = 16000
    max_batch_prefill_tokens: int = 4096
    waiting_served_ratio: float = 1.2
    max_waiting_tokens: int = 20
    name: str = "tgi"
    _waiting_tokens: int = 0

    def plan(self, waiting: list[Row], running: list[Row], now: float) -> Plan:
        plan = Plan()
        if waiting:
            min_size = 0
            if running and self._waiting_tokens < self.max_waiting_tokens:
                min_size = int(len(running) * self.waiting_served_ratio)
            budget = self.max_batch_total_tokens - sum(r.prompt + r.limit for r in running)
            prefill = 0
            for r in waiting:
                if prefill + r.prompt > self.max_batch_prefill_tokens or r.prompt + r.limit > budget:
                    break
                plan.admit.append(r)
                plan.prefill.append((r, r.prompt))
                prefill += r.prompt
                budget -= r.prompt + r.limit
            if plan.admit and len(plan.admit) >= max(1, min_size):
                self._waiting_tokens = 1
                return plan
            plan = Plan()
        plan.decode = any(r.ready for r in running)
        self._waiting_tokens += 1
        return plan


@dataclass
class SGLang:
    chunked_prefill_size: int = 8192
    schedule_conservativeness: float = 1.0
    kv_tokens: int = 1 << 30
    max_running: int = 1 << 20
    name: str = "sglang"
    new_token_ratio: float = 0.7

    def plan(self, waiting: list[Row], running: list[Row], now: float) -> Plan:
        plan = Plan()
        ratio = min(1.0, self.new_token_ratio * self.schedule_conservativeness)
        reserved = sum(r.prompt + max(r.emitted, ratio * r.limit) for r in running)
        budget = self.chunked_prefill_size
        for r in running:
            if not r.ready:
                chunk = min(r.prompt - r.prefilled, budget)
                plan.prefill.append((r, chunk))
                budget -= chunk
        seqs = len(running)
        for r in waiting:
            if budget <= 0 or seqs >= self.max_running:
                break
            need = r.prompt + ratio * r.limit
            if reserved + need > self.kv_tokens:
                break
            chunk = min(r.prompt, budget)
            plan.admit.append(r)
            plan.prefill.append((r, chunk))
            budget -= chunk
            reserved += need
            seqs += 1
        plan.decode = not plan.prefill and any(r.ready for r in running)
        return plan


@dataclass
class FixedWindowGen:
    window_ms: float = 20.0
    cap: int = 48
    kv_tokens: int = 1 << 30
    name: str = "fixed-window"
    padded: bool = True
    """The field report's service batches a plain transformers model: prompts left-padded."""

    def plan(self, waiting: list[Row], running: list[Row], now: float) -> Plan:
        plan = Plan()
        if running:
            plan.decode = True
            return plan
        if not waiting:
            return plan
        oldest = min(r.arrival for r in waiting)
        if len(waiting) < self.cap and now < oldest + self.window_ms:
            plan.wake_at_ms = oldest + self.window_ms
            return plan
        used = 0
        for r in waiting[: self.cap]:
            if plan.admit and used + r.prompt + r.limit > self.kv_tokens:
                break
            plan.admit.append(r)
            plan.prefill.append((r, r.prompt))
            used += r.prompt + r.limit
        return plan


def iteration_ms(
    cost: GenerationCost, prefill: list[tuple[Row, int]], decode: list[Row], padded: bool, kernels: Kernels = "runner"
) -> float:
    """One iteration: one decode step of the ready rows, and the prompt chunks.

    `runner` (the default): the kernels batchtide's runner measured, the same for every scheduler:
    a prefill alone pads its rows to the longest chunk, and prompt tokens fused with a decode step
    cost what batchtide's loop pays for a ride on this device (a fixed part and a part per token,
    GenerationCost.ride_fixed and ride_token_ms, when the device has a ride price; else chunks.py:
    `RIDE_SHARE` of the step per chunk of `STEP_TOKEN_BUDGET` less the decoding rows tokens). `ragged`: the servers' own kernels, idealised: a ragged batch
    (no padding: the chunks' tokens), fused with the step when there is one (its weights are
    read once: only the tokens' share of a prefill is added). A `padded` scheduler (static
    batching on a plain transformers model) pays rows x the longest prompt with either."""
    ms = 0.0
    step = 0.0
    if decode:
        width = max(r.kv for r in decode)
        step = cost.step_ms(len(decode), width)
        ms += step
    if prefill:
        tokens = sum(t for _, t in prefill)
        if padded or (kernels == "runner" and not decode):
            ms += cost.prefill_ms(len(prefill), max(t for _, t in prefill))
        elif kernels == "runner" and cost.ride_token_ms():
            ms += cost.ride_fixed() + tokens * (cost.ride_token_ms() or 0.0)
        elif kernels == "runner":
            ms = ride_ms(step, rides(tokens, STEP_TOKEN_BUDGET, len(decode)))
        elif decode:
            ms += max(0.0, cost.prefill_ms(1, tokens) - cost.prefill_ms(1, 1))
        else:
            ms += cost.prefill_ms(1, tokens)
    return ms


def simulate_tokens(
    arrivals: GenArrivals, cost: GenerationCost, scheduler: TokenScheduler, kernels: Kernels = "runner"
) -> GenOutcome:
    """Run one scheduler on one device over the arrivals (lanes are ignored: one server), charged
    the runner's measured kernels or the servers' idealised ragged ones (`iteration_ms`)."""
    arr = arrivals
    n = len(arr)
    first = np.full(n, np.nan)
    done = np.full(n, np.nan)
    disp = np.full(n, np.nan)
    expired = np.zeros(n, dtype=bool)
    waiting: list[Row] = []
    running: list[Row] = []
    step_rows: list[int] = []
    answered = 0
    now = 0.0
    k = 0
    admitted = 0
    steps = joins = 0
    deadline = arr.deadline_ms
    due = bool(np.isfinite(deadline).any())
    """Whether any request has a deadline (without, the scan for the expired is skipped: at overload it
    took most of the run, over a queue of thousands)."""
    deliver = arr.deliver_ms
    gap = 0.0

    def answer(row: Row, t: float, late: bool) -> None:
        nonlocal answered
        done[row.i] = t
        expired[row.i] = late
        answered += 1

    while answered < n:
        while k < n and deliver[k] <= now:
            waiting.append(Row(k, float(arr.create_ms[k]), int(arr.prompt[k]), int(arr.limit[k]), int(arr.priority[k])))
            k += 1
        for pool in (waiting, running) if due else ():
            for r in [r for r in pool if not np.isnan(deadline[r.i]) and deadline[r.i] <= now]:
                pool.remove(r)
                answer(r, now, True)
        if answered >= n:
            break
        preempt = getattr(scheduler, "preempt", None)
        while preempt is not None and (victim := preempt(running)) is not None:
            running.remove(victim)
            victim.prompt += victim.emitted - victim.folded
            victim.folded, victim.prefilled = victim.emitted, 0
            waiting.insert(0, victim)
        plan = scheduler.plan(waiting, running, now) if (waiting or running) else Plan()
        for r in plan.admit:
            waiting.remove(r)
            admitted += 1
            r.admitted = admitted
            running.append(r)
            if np.isnan(disp[r.i]):
                disp[r.i] = now
        decode = [r for r in running if r.ready] if plan.decode else []
        ms = iteration_ms(cost, plan.prefill, decode, getattr(scheduler, "padded", False), kernels)
        if ms <= 0.0:
            nxt = [float(deliver[k])] if k < n else []
            if plan.wake_at_ms is not None:
                nxt.append(plan.wake_at_ms)
            if not nxt:
                raise RuntimeError(f"{scheduler.name}: {n - answered} requests stuck with nothing to run")
            now = max(now, min(nxt))
            continue
        now += ms
        if plan.admit:
            joins += 1
        if decode:
            steps += 1
            step_rows.append(len(decode))
        for r in decode:
            gap = max(gap, now - r.last_ms)
            r.last_ms = now
            r.emitted += 1
        for r, chunk in plan.prefill:
            r.prefilled += chunk
            if r.ready and r.emitted == 0:
                r.emitted = 1
                r.last_ms = first[r.i] = now
        for r in [r for r in running if r.emitted >= min(arr.emits[r.i], r.limit)]:
            running.remove(r)
            answer(r, now, False)
    return GenOutcome(arr, disp, first, done, expired, [1] * n, steps, joins, step_rows, gap)
