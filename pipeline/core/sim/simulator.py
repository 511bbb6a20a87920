"""Discrete-event simulator: drives any BatchPolicy with a virtual clock.

Arrivals come pre-generated in delivery order; completions and policy wake-ups
live in one heap. Each queue (lane) has its own policy object; a lane owns one
device (own queues, like Kafka partitions), several lanes share one device
(models sharing a GPU, served first-ready in alternating order), or one lane
feeds several devices (shared queue). A policy is polled after every arrival
that finds a free device (every arrival when requests carry deadlines, as the
live consumer does: a policy may answer what it cannot serve in time at once),
every completion and every wake-up it asked for, and learns from `completed()`
with the simulated compute time. A replay passes a `Timeline` (timeline.py):
its batches then take the recorded device's speed at the moment they run, the
device is held for the recorded gap before compute too, and answers leave
after the recorded publish gap.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from pipeline.core.engine.decisions import Batch, BatchPolicy, PendingRequest
from pipeline.core.sim.arrivals import Arrivals
from pipeline.core.sim.scenario import Scenario
from pipeline.core.sim.timeline import Timeline

_COMPLETE = 0
_WAKE = 1


class SimulationError(RuntimeError):
    """A policy broke the contract (dispatch with no free device, lost requests)."""


@dataclass
class BatchLog:
    """One row per dispatched batch, as parallel lists."""

    dispatch_ms: list[float]
    size: list[int]
    hit_target: list[bool]
    window_ms: list[float]
    marked: list[int]
    compute_ms: list[float]
    lane: list[int]
    effective_cap: list[int]


@dataclass
class RunOutcome:
    """Per-request times of one run, indexed like the Arrivals."""

    arrivals: Arrivals
    dispatch_ms: np.ndarray
    done_ms: np.ndarray
    expired: np.ndarray
    marked: np.ndarray
    batches: BatchLog
    aborted: bool
    over_slo: int
    wall_s: float
    events: int
    offered: int
    """Arrivals handed to the policies (all of them unless the run was aborted)."""

    @property
    def requests(self) -> int:
        return len(self.arrivals)


def simulate(
    scenario: Scenario,
    arrivals: Arrivals,
    policies: Sequence[BatchPolicy],
    abort_over_slo: int | None = None,
    timeline: Timeline | None = None,
) -> RunOutcome:
    """Run one realisation to the end (every request answered), or stop early once more
    than `abort_over_slo` requests are known to miss the SLO (capacity search)."""
    topo = scenario.topology
    lanes = topo.lanes
    if len(policies) != lanes:
        raise ValueError(f"scenario {scenario.name} has {lanes} queues, got {len(policies)} policies")
    cost = scenario.cost
    slo = scenario.slo_p99_ms
    deadline = scenario.deadline_ms
    max_batch = cost.max_batch
    # A policy counting tokens (profile cost_unit) sees each request's tokens as its cost.
    token_cost = cost.unit == "tokens"
    n = len(arrivals)
    create = arrivals.create_ms.tolist()
    deliver = arrivals.deliver_ms.tolist()
    tokens = arrivals.tokens.tolist()
    prio = arrivals.priority.tolist()
    lane_of = arrivals.lane.tolist()
    disp = [np.nan] * n
    done = [np.nan] * n
    expired = [False] * n
    marked = [False] * n
    log = BatchLog([], [], [], [], [], [], [], [])

    n_devices = topo.devices
    busy = [False] * n_devices
    device_lanes: list[list[int]] = [[] for _ in range(n_devices)]
    lane_devs = [topo.lane_devices(lane) for lane in range(lanes)]
    for lane in range(lanes):
        for d in lane_devs[lane]:
            device_lanes[d].append(lane)
    next_turn = [0] * n_devices
    scale = [topo.lane_cost_scale(lane) for lane in range(lanes)]
    wake_version = [0] * lanes
    heap: list[tuple[float, int, int, int, object]] = []
    seq = 0
    answered = 0
    over = 0
    limit = abort_over_slo if abort_over_slo is not None else n + 1
    events = 0

    def free_device(lane: int) -> int:
        for d in lane_devs[lane]:
            if not busy[d]:
                return d
        return -1

    def poll(lane: int, now: float) -> bool:
        """Poll one lane until it stops dispatching; True if it started a batch."""
        nonlocal seq, answered, over
        policy = policies[lane]
        started = False
        while True:
            dev = free_device(lane)
            decision = policy.poll(now, dev >= 0, 0)
            for req in decision.expired:
                i = req.payload
                expired[i] = True
                done[i] = now
                answered += 1
                over += 1
            batch = decision.batch
            if batch is not None:
                if dev < 0:
                    raise SimulationError(f"{type(policy).__name__} dispatched with no free device")
                reqs = batch.requests
                tok = 0
                for req in reqs:
                    i = req.payload
                    disp[i] = now
                    tok += tokens[i]
                hold = publish = 0.0
                if timeline is None:
                    compute = cost.batch_ms(len(reqs), tok, now, scale[lane])
                else:
                    timed = timeline.batch(lane, len(reqs), tok, now)
                    compute, hold, publish = scale[lane] * timed.compute_ms, timed.start_gap_ms, timed.publish_gap_ms
                if max_batch is not None and len(reqs) > max_batch:
                    raise SimulationError(f"{type(policy).__name__} dispatched {len(reqs)} > device limit {max_batch}")
                busy[dev] = True
                seq += 1
                heapq.heappush(heap, (now + hold + compute, seq, _COMPLETE, dev, (lane, batch, compute, publish)))
                rec = batch.record
                log.dispatch_ms.append(now)
                log.size.append(len(reqs))
                log.hit_target.append(rec.hit_target)
                log.window_ms.append(rec.window_ms)
                log.marked.append(rec.marked_count)
                log.compute_ms.append(compute)
                log.lane.append(lane)
                log.effective_cap.append(rec.effective_cap)
                started = True
                continue
            wake = decision.wake_at_ms
            if wake is not None and not (wake <= now and free_device(lane) < 0):
                wake_version[lane] += 1
                seq += 1
                heapq.heappush(heap, (max(wake, now + 0.001), seq, _WAKE, lane, wake_version[lane]))
            return started

    wall0 = time.perf_counter()
    i = 0
    aborted = False
    inf = float("inf")
    while answered < n:
        t_arr = deliver[i] if i < n else inf
        if heap and heap[0][0] <= t_arr:
            now, _, kind, who, data = heapq.heappop(heap)
            events += 1
            if kind == _COMPLETE:
                lane, batch, compute, publish = cast(tuple[int, Batch, float, float], data)
                busy[who] = False
                answer = now + publish
                for req in batch.requests:
                    j = req.payload
                    done[j] = answer
                    if req.marked:
                        marked[j] = True
                    if answer - create[j] > slo:
                        over += 1
                answered += len(batch.requests)
                policies[lane].completed(batch, now, compute)
                order = device_lanes[who]
                k = len(order)
                start = next_turn[who]
                for step in range(k):
                    ln = order[(start + step) % k]
                    if poll(ln, now):
                        next_turn[who] = (start + step + 1) % k
                        break
            else:
                if data == wake_version[who]:
                    poll(who, now)
            if over > limit:
                aborted = True
                break
            continue
        if i >= n:
            stuck = n - answered
            raise SimulationError(f"{stuck} requests were never answered (policy holds them with no wake-up)")
        now = t_arr
        lane = lane_of[i]
        policies[lane].offer(
            PendingRequest(
                str(i),
                create[i],
                tokens[i] if token_cost else 1,
                prio[i],
                None if deadline is None else create[i] + deadline,
                i,
            ),
            now,
        )
        i += 1
        events += 1
        if free_device(lane) >= 0 or deadline is not None:
            poll(lane, now)
        if over > limit:
            aborted = True
            break
    wall = time.perf_counter() - wall0
    return RunOutcome(
        arrivals=arrivals,
        dispatch_ms=np.asarray(disp, dtype=float),
        done_ms=np.asarray(done, dtype=float),
        expired=np.asarray(expired, dtype=bool),
        marked=np.asarray(marked, dtype=bool),
        batches=log,
        aborted=aborted,
        over_slo=over,
        wall_s=wall,
        events=events,
        offered=i,
    )


def conservation_problems(outcome: RunOutcome) -> list[str]:
    """Every arrival answered exactly once (served or expired); used by tests."""
    problems = []
    served = ~np.isnan(outcome.done_ms) & ~outcome.expired
    if int(served.sum()) + int(outcome.expired.sum()) != outcome.requests:
        problems.append("some requests were neither served nor expired")
    if int(sum(outcome.batches.size)) != int(served.sum()):
        problems.append(f"batch sizes sum to {sum(outcome.batches.size)} but {int(served.sum())} requests were served")
    return problems
