"""batchtide's batching policy: offer / poll / completed in, decisions out (docs/engine.md).

Pure and deterministic: every time is passed in by the driver (the live
consumer's clock or the simulator's virtual one); nothing here reads a clock,
sleeps, does I/O or draws a random number. One poll decides, in this order:

1. expire requests whose deadline passed (answered, never run), and shed
   those the queue and t(b) say can no longer finish in time (shedding.py:
   at arrival, at the head of the queue, and inside a batch about to leave);
2. mark tails (wait > tail_mark_ratio x a rolling upper quantile of waits) so
   they go first;
3. with a free slot: dispatch at the effective cap (`hard_cap`), at the
   target (`target`), or when the window ends (`idle` if it was zero,
   `max_wait` if the engine held the batch) — the window is measured from the
   oldest pending request's record time and is never longer than max_wait_ms.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

from pipeline.core.config import AUTO_CEILING, AUTO_RAMP_START, AUTO_TARGET_SHARE, BatchProfile
from pipeline.core.engine.costcurve import CostCurve
from pipeline.core.engine.decisions import (
    Batch,
    Decision,
    DispatchReason,
    DispatchRecord,
    PendingRequest,
)
from pipeline.core.engine.pending import PendingQueue
from pipeline.core.engine.shedding import DEADLINE_PASSED, Overruns, ShedRule, finish_estimate_ms, split_late
from pipeline.core.engine.tails import WaitTracker
from pipeline.core.engine.window import ArrivalRate, paying_wait_ms


class BatchingEngine:
    """The rate-adaptive batching policy for one model on one consumer (a ServingPolicy)."""

    def __init__(
        self,
        profile: BatchProfile,
        *,
        device_cap: int | None = None,
        prior_costs: Sequence[tuple[int, float]] = (),
    ) -> None:
        """`device_cap`: the largest batch (in the profile's cost unit) that fits the
        device's memory, from its measured profile (the simulator passes the
        scenario's `[cost] max_batch`); it is the ceiling of `hard_cap = "auto"` and
        bounds an explicit hard_cap too. `prior_costs`: measured (size, ms) points of
        t(b) that prefill the cost curve, so the cap starts at the knee, not cold."""
        if device_cap is not None and device_cap < 1:
            raise ValueError(f"device_cap must be >= 1 (got {device_cap})")
        self.profile = profile
        self._tokens = profile.cost_unit == "tokens"
        ceiling = AUTO_CEILING[profile.cost_unit] if profile.hard_cap == "auto" else profile.hard_cap
        if device_cap is not None:
            ceiling = device_cap if profile.hard_cap == "auto" else min(ceiling, device_cap)
        self.ceiling = ceiling
        """Largest batch ever dispatched: the resolved hard_cap."""
        self._fixed_target = None if profile.target_size == "auto" else min(profile.target_size, ceiling)
        # An auto ceiling is a memory limit, never a size anyone measured: with or
        # without a prefilled curve the cap climbs to it by doublings from the sizes
        # measured, so a curve a shift (or a slower device) has dropped never sends
        # the whole queue as one batch.
        ramp = profile.cap_ramp or profile.hard_cap == "auto"
        start = self._fixed_target or min(AUTO_RAMP_START[profile.cost_unit], ceiling)
        self._queue = PendingQueue(profile.priority_levels, self._tokens)
        self._deadlines: list[tuple[float, int, PendingRequest]] = []
        self._shed_rule = ShedRule(profile.shed_when, profile.slo_p99_ms)
        self._shed: list[PendingRequest] = []
        """Requests shed since the last poll (answered by it)."""
        self._overruns = Overruns()
        self._rate = ArrivalRate(profile.rate_halflife_ms)
        self._waits = WaitTracker(
            profile.wait_sample_window,
            profile.tail_min_samples,
            profile.tail_mark_ratio,
            profile.max_wait_ms if profile.tail_mark_floor_ms is None else profile.tail_mark_floor_ms,
            profile.tail_mark_quantile,
        )
        self._mark_budget_max = (
            math.inf if profile.tail_mark_max_share >= 1 else profile.tail_mark_max_share * profile.wait_sample_window
        )
        self._mark_budget = self._mark_budget_max
        """Marks that may still be made (see `tail_mark_max_share`)."""
        self._curve = CostCurve(
            ceiling,
            profile.knee_tolerance,
            profile.budget_ms(),
            overhead_ms=profile.batch_overhead_ms,
            start_cap=start if ramp else None,
            enabled=profile.adaptive_cap,
        )
        if prior_costs:
            self._curve.prefill(list(prior_costs))
        self._inflight: dict[int, float] = {}
        """batch id -> expected completion (ms), from the cost curve; inf if unknown."""
        self._last_batch_id = 0
        self._window_ms = 0.0
        self._held = False
        """The forming batch was held at least once (its dispatch is a window expiry)."""
        self._last_now = 0.0
        """Latest poll time: stats() takes no clock, it reports as of the last poll."""
        self.expired_total = 0
        """Requests answered `expired`: their deadline passed, or shed (counted in shed_total too)."""
        self.shed_total = 0
        self.dispatched_total = 0

    @property
    def pending(self) -> int:
        return self._queue.count

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def curve(self) -> CostCurve:
        return self._curve

    @property
    def target_size(self) -> int:
        """The target in force: explicit, or two thirds of the learned cap (`auto`)."""
        return self._target(self._curve.latency_cap)

    def _target(self, cap: int) -> int:
        if self._fixed_target is not None:
            return self._fixed_target
        return max(1, round(AUTO_TARGET_SHARE * cap))

    def _cap_for(self, backlog: int) -> int:
        """The budget shapes batches only while the queue is short: once more waits
        than a budgeted batch holds, the throughput knee serves it, so no budget
        can make the pipeline slower than its arrivals."""
        curve = self._curve
        queue = self._queue
        depth = queue.cost
        if backlog and queue.count:
            depth += math.ceil(backlog * queue.cost / queue.count)
        return curve.latency_cap if depth <= curve.latency_cap else curve.cap

    def offer(self, request: PendingRequest, now_ms: float) -> None:
        """Queue a request; works whether or not the device is busy."""
        self._rate.observe(now_ms, request.cost if self._tokens else 1)
        deadline = request.deadline_ms
        if deadline is None and self.profile.default_deadline_ms is not None:
            deadline = request.enqueue_ms + self.profile.default_deadline_ms
        limit = self._shed_rule.limit(request.enqueue_ms, deadline)
        if limit is not None:
            request.finish_by_ms, request.finish_by_reason = limit
            own = request.cost if self._tokens else 1
            done = self._finish_ms(now_ms, self._queue.cost_ahead(request.priority) + own)
            if done is not None and done > request.finish_by_ms:
                self._shed_one(request, done)
                return
        seq = request.seq = self._queue.add(request)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, seq, request))

    def withdraw(self, request: PendingRequest) -> bool:
        """Take back a pending request (forwarded to another consumer, or its
        partition was revoked); False if it already left in a batch or expired."""
        return self._queue.remove(request.seq, request)

    def poll(self, now_ms: float, device_free: bool = True, backlog: int = 0) -> Decision:
        """Decide at `now_ms`; after a batch, poll again (another slot may be free)."""
        expired = self._expire(now_ms)
        self._shed_heads(now_ms)
        decision = self._decide(now_ms, device_free, backlog, expired)
        shed = self._shed
        if shed:
            decision.expired.extend(shed)
            self.expired_total += len(shed)
            self.shed_total += len(shed)
            self._shed = []
        return decision

    def _decide(self, now_ms: float, device_free: bool, backlog: int, expired: list[PendingRequest]) -> Decision:
        queue = self._queue
        if queue.count == 0:
            self._held = False
            self._window_ms = 0.0
            return Decision(None, expired, self._next_deadline())
        free = self.profile.max_inflight_batches - len(self._inflight) if device_free else 0
        if free <= 0:
            return Decision(None, expired, self._next_deadline())
        threshold = self._waits.threshold_ms()
        if threshold is not None and self._mark_budget >= 1.0:
            limit = queue.count if self._mark_budget == math.inf else int(self._mark_budget)
            self._mark_budget -= queue.mark_older_than(threshold, now_ms, limit)

        cap = self._cap_for(backlog)
        pending_cost = queue.cost
        reason: DispatchReason
        if pending_cost >= cap:
            reason, window = "hard_cap", 0.0
        elif pending_cost >= self._target(cap):
            reason, window = "target", 0.0
        else:
            oldest = queue.oldest_enqueue_ms()
            assert oldest is not None
            window = self._window(now_ms, oldest, free, backlog, cap)
            self._window_ms = window
            wake = oldest + window
            if wake > now_ms:
                self._held = True
                deadline = self._next_deadline()
                return Decision(None, expired, wake if deadline is None else min(wake, deadline))
            if self._held:
                reason, window = "max_wait", min(now_ms - oldest, self.profile.max_wait_ms)
            else:
                reason = "max_wait" if window > 0.0 else "idle"
        batch = self._dispatch(now_ms, reason, window, cap, backlog)
        more = queue.count > 0 and free > 1
        return Decision(batch, expired, now_ms if more else self._next_deadline())

    def completed(self, batch: Batch, now_ms: float, compute_ms: float) -> None:
        """The device finished `batch` after `compute_ms` of compute: free its slot, learn t(b)."""
        expected_end = self._inflight.pop(batch.batch_id, None)
        if expected_end is not None:
            self._overruns.observe(compute_ms, expected_end - batch.record.dispatch_ms)
        self._curve.observe(batch.record.cost, compute_ms)

    def stats(self) -> dict[str, Any]:
        """Cheap snapshot for logs and gauges."""
        return {
            "pending": self._queue.count,
            "pending_cost": self._queue.cost,
            "inflight": len(self._inflight),
            "dispatched": self.dispatched_total,
            "expired": self.expired_total,
            "shed": self.shed_total,
            "marked_share": self._waits.marked_share,
            "window_ms": self._window_ms,
            "effective_cap": self._curve.cap,
            "cap_reason": self._curve.reason,
            "latency_cap": self._curve.latency_cap,
            "target_size": self.target_size,
            "p50_wait_ms": self._waits.p50_ms,
            "tail_threshold_ms": self._waits.threshold_ms(),
            "arrival_rate_per_s": self._rate.requests_per_ms(self._last_now) * 1000.0,
        }

    def _window(self, now_ms: float, oldest_ms: float, free: int, backlog: int, cap: int) -> float:
        """Total wait allowed for the oldest pending request, from its record time."""
        profile = self.profile
        if not profile.adaptive_window:
            return profile.max_wait_ms
        rate = self._rate
        request_rate = rate.requests_per_ms(now_ms)
        cost_rate = rate.cost_per_ms(now_ms)
        per_request = cost_rate / request_rate if request_rate > 0 else 1.0
        pending_cost = self._queue.cost
        next_free = min(self._inflight.values()) if free == 1 and self._inflight else None
        wait = paying_wait_ms(
            now_ms=now_ms,
            pending_cost=pending_cost,
            depth_cost=pending_cost + math.ceil(backlog * per_request),
            goal_cost=min(self._target(cap), cap),
            cost_rate_per_ms=cost_rate,
            request_rate_per_ms=request_rate,
            free_slots=free,
            next_slot_free_ms=next_free,
            batch_time_ms=self._curve.estimate_ms,
        )
        window = now_ms - oldest_ms + wait if wait > 0.0 else 0.0
        return min(max(window, profile.min_wait_ms), profile.max_wait_ms)

    def _dispatch(self, now_ms: float, reason: DispatchReason, window: float, cap: int, backlog: int) -> Batch:
        queue = self._queue
        curve = self._curve
        take_cap = cap
        cap_reason = curve.latency_reason if cap < curve.cap else curve.reason
        if reason == "hard_cap" and cap == curve.cap:
            probe = curve.probe_cap()
            if probe is not None:
                take_cap = probe
                cap_reason = "shift" if curve.shifting else "probe"
        cost_before = queue.cost
        requests = queue.take(take_cap)
        cost = cost_before - queue.cost
        requests, cost = self._shed_late_members(requests, cost, now_ms)
        waits = [now_ms - request.enqueue_ms for request in requests]
        marked = 0
        for request in requests:
            if request.marked:
                marked += 1
        self._waits.record(waits, marked)
        self._mark_budget = min(
            self._mark_budget_max, self._mark_budget + self.profile.tail_mark_max_share * len(requests)
        )
        oldest_wait = max(waits) if waits else 0.0
        self._last_batch_id += 1
        batch_id = self._last_batch_id
        estimate = curve.estimate_ms(cost)
        self._inflight[batch_id] = now_ms + estimate if estimate is not None else math.inf
        self._held = False
        self.dispatched_total += len(requests)
        record = DispatchRecord(
            batch_id=batch_id,
            size=len(requests),
            cost=cost,
            reason=reason,
            window_ms=window,
            hit_target=cost >= self._target(cap),
            target_size=self._target(cap),
            marked_count=marked,
            oldest_wait_ms=oldest_wait,
            queue_depth=queue.count + backlog,
            effective_cap=take_cap,
            arrival_rate_per_s=self._rate.requests_per_ms(now_ms) * 1000.0,
            dispatch_ms=now_ms,
            cap_reason=cap_reason,
        )
        return Batch(batch_id, requests, record)

    def _expire(self, now_ms: float) -> list[PendingRequest]:
        self._last_now = now_ms
        queue = self._queue
        if len(self._deadlines) > 4 * queue.count + 1024:
            live = [e for e in self._deadlines if queue.is_live(e[1])]
            heapq.heapify(live)
            self._deadlines = live
        deadlines = self._deadlines
        if not deadlines or deadlines[0][0] > now_ms:
            return []
        expired: list[PendingRequest] = []
        while deadlines and deadlines[0][0] <= now_ms:
            _, seq, request = heapq.heappop(deadlines)
            if queue.remove(seq, request):
                request.expiry = DEADLINE_PASSED
                expired.append(request)
        self.expired_total += len(expired)
        return expired

    def _next_deadline(self) -> float | None:
        deadlines = self._deadlines
        queue = self._queue
        while deadlines and not queue.is_live(deadlines[0][1]):
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    # ---- shedding (shedding.py) -----------------------------------------------

    def _slot_free_ms(self, now_ms: float) -> float:
        """When the next batch can start: now with a free slot, else the earliest expected completion."""
        inflight = self._inflight
        if len(inflight) < self.profile.max_inflight_batches or not inflight:
            return now_ms
        soonest = min(inflight.values())
        return now_ms if soonest == math.inf else max(now_ms, soonest)

    def _finish_ms(self, now_ms: float, cost_ahead: float) -> float | None:
        """Expected finish of a request with `cost_ahead` queued ahead of it (its own included)."""
        curve, rate = self._curve, self._rate
        arriving = rate.cost_per_ms(now_ms) if self._tokens else rate.requests_per_ms(now_ms)
        return finish_estimate_ms(
            now_ms,
            self._slot_free_ms(now_ms),
            cost_ahead,
            curve.cap,
            self.profile.max_inflight_batches,
            curve.estimate_ms,
            self.profile.batch_overhead_ms,
            arriving,
            self._overruns.margin,
        )

    def _shed_heads(self, now_ms: float) -> None:
        """Shed the head of the queue while even the next batch cannot finish it in time."""
        queue = self._queue
        while queue.count:
            head = queue.head()
            if head is None or head.finish_by_ms is None:
                return
            done = self._finish_ms(now_ms, min(queue.cost, self._curve.cap))
            if done is None or done <= head.finish_by_ms:
                return
            queue.remove(head.seq, head)
            self._shed_one(head, done)

    def _shed_late_members(
        self, requests: list[PendingRequest], cost: int, now_ms: float
    ) -> tuple[list[PendingRequest], int]:
        """Members of a leaving batch that it would finish too late for (a later level's
        or a marked request can have an earlier limit than the head's) are shed, not run."""
        estimate = self._curve.estimate_ms(cost)
        if estimate is None:
            return requests, cost
        done = now_ms + estimate * self._overruns.margin + self.profile.batch_overhead_ms
        kept, late = split_late(requests, done)
        if not late:
            return requests, cost
        for request in late:
            self._shed_one(request, done)
        return kept, sum(r.cost for r in kept) if self._tokens else len(kept)

    def _shed_one(self, request: PendingRequest, done_ms: float) -> None:
        request.expiry = request.finish_by_reason
        request.predicted_done_ms = done_ms
        self._shed.append(request)
