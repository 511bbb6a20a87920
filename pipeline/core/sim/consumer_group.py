"""The consumer group under a virtual clock: one engine and one device per consumer, and
group-relative forwarding between them exactly as the live consumer does it.

Each consumer (a lane) owns the partitions its assignment gives it (Kafka's
range assignor, or counts in proportion to its speed) and runs batchtide's own `BatchingEngine` on its own device, whose t(b) is
the scenario's times the consumer's speed factor at dispatch. With
forwarding on, every consumer:

- publishes a beacon (`MemberView`) every `beacon_interval_ms`: how soon a
  request handed to it would start (`start_in_ms` over its queue and its
  learned curve), its recent batch time, its capacity and its priority partitions. Peers see
  it one hop later and until the next one: beacons are as stale as live;
- every `scan_interval_ms`, and whenever its device is free and it is about
  to poll its engine (a completion, an arrival), calls `plan_forwards` over
  its waiting requests in dispatch order, with the running batch's time left as its engine
  predicted it at dispatch (the consumer knows no better) and its peers'
  beacons from the one after it (`peers_after`), and hands each chosen request to the peer one
  hop later, with its original record time and priority 0 (the priority
  topic), never to be forwarded again.

The device models only the compute; publishing an answer costs nothing
here. Every request is answered exactly once or the run fails.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import cast

import numpy as np

from pipeline.core.config import BatchProfile
from pipeline.core.engine import BatchingEngine
from pipeline.core.engine.decisions import Batch, PendingRequest
from pipeline.core.engine.peer_forwarding import (
    Flow,
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
from pipeline.core.sim.arrivals import Arrivals
from pipeline.core.sim.families import DEFAULT_DEVICE_CAP, LaneContext, build_engine
from pipeline.core.sim.fleetspec import FleetSpec
from pipeline.core.sim.scenario import Scenario
from pipeline.core.sim.simulator import SimulationError

_ARRIVE_FORWARD, _COMPLETE, _WAKE, _SCAN, _BEACON, _BEACON_SEEN = range(6)


@dataclass
class FleetOutcome:
    """Per-request times of one fleet run, indexed like the Arrivals."""

    arrivals: Arrivals
    done_ms: np.ndarray
    expired: np.ndarray
    served_by: np.ndarray
    """Consumer whose device answered the request (-1: expired)."""
    forwarded: np.ndarray
    """The request was handed to a peer."""
    forwards_out: np.ndarray
    """Per consumer: requests it handed to peers."""
    forwards_in: np.ndarray
    """Per consumer: requests it received from peers."""
    batch_sizes: list[int]
    consumers: int


def fleet_variant(scenario: Scenario, variant: str) -> Scenario:
    """The scenario as the `off` (equal partitions, no forwarding: today), `on` (forwarding),
    `weighted` (partitions in proportion to speed, no forwarding), `weighted+on` (both) or
    `ideal` (every device fast, keys even, no forwarding) run."""
    fleet = scenario.fleet
    if fleet is None:
        raise ValueError(f"scenario {scenario.name} has no [fleet] table")
    spec = {
        "off": replace(fleet, forwarding=False),
        "on": replace(fleet, forwarding=True),
        "weighted": replace(fleet, forwarding=False, assignment="capacity"),
        "weighted+on": replace(fleet, forwarding=True, assignment="capacity"),
        "ideal": fleet.ideal(),
    }[variant]
    return replace(scenario, fleet=spec)


def _engines(scenario: Scenario, fleet: FleetSpec) -> list[BatchingEngine]:
    """batchtide-default per consumer, started from the profile of its own (steady) device."""
    cost = scenario.cost
    cap = cost.max_batch or DEFAULT_DEVICE_CAP
    mean_tokens = scenario.mean_tokens()
    engines = []
    for c in range(scenario.topology.consumers):
        engine = build_engine(
            BatchProfile(),
            LaneContext(
                1,
                1,
                cap,
                cost.profile_points(cap, mean_tokens, fleet.steady_factor(c)),
            ),
        )
        assert isinstance(engine, BatchingEngine)
        engines.append(engine)
    return engines


def simulate_fleet(scenario: Scenario, arrivals: Arrivals) -> FleetOutcome:
    """Run the group to the end: every request answered once (served or expired)."""
    fleet = scenario.fleet
    if fleet is None:
        raise ValueError(f"scenario {scenario.name} has no [fleet] table")
    consumers = scenario.topology.consumers
    cost = scenario.cost
    token_cost = cost.unit == "tokens"
    deadline = scenario.deadline_ms
    engines = _engines(scenario, fleet)
    owned = fleet.owned(consumers)
    rule = ForwardRule(hop_ms=fleet.hop_ms)
    forwarding = fleet.forwarding and consumers > 1

    n = len(arrivals)
    create = arrivals.create_ms.tolist()
    deliver = arrivals.deliver_ms.tolist()
    tokens = arrivals.tokens.tolist()
    prio = arrivals.priority.tolist()
    lane_of = arrivals.lane.tolist()
    done = [np.nan] * n
    expired = [False] * n
    served_by = [-1] * n
    forwarded = [False] * n
    forwarded_in = [False] * n
    forwards_out = [0] * consumers
    forwards_in = [0] * consumers
    sizes: list[int] = []

    busy = [False] * consumers
    busy_until_est = [0.0] * consumers
    """When the running batch ends by the engine's own estimate at dispatch."""
    batch_ms = [0.0] * consumers
    """Each consumer's recent batch time, as its beacon says it."""
    flows = [Flow() for _ in range(consumers)]
    waiting: list[dict[int, PendingRequest]] = [{} for _ in range(consumers)]
    board: list[MemberView | None] = [None] * consumers
    """The beacons every consumer sees now (the fleet topic, one hop behind), by member id."""
    sent: list[dict[str, int]] = [{} for _ in range(consumers)]
    sent_since: list[dict[str, float]] = [{} for _ in range(consumers)]
    wake_version = [0] * consumers
    heap: list[tuple[float, int, int, int, object]] = []
    seq = 0
    work = 0
    """Events in the heap that answer requests or may (completions, wake-ups, forwards in flight)."""
    answered = 0

    def push(at: float, kind: int, lane: int, data: object) -> None:
        nonlocal seq, work
        seq += 1
        if kind in (_ARRIVE_FORWARD, _COMPLETE, _WAKE):
            work += 1
        heapq.heappush(heap, (at, seq, kind, lane, data))

    def answer_expired(lane: int, reqs: list[PendingRequest], now: float) -> None:
        nonlocal answered
        for req in reqs:
            i = req.payload
            if not np.isnan(done[i]):
                raise SimulationError(f"request {i} answered twice (expired on consumer {lane})")
            del waiting[lane][i]
            expired[i] = True
            done[i] = now
            answered += 1

    def poll(lane: int, now: float) -> None:
        engine = engines[lane]
        decision = engine.poll(now, not busy[lane], 0)
        answer_expired(lane, decision.expired, now)
        batch = decision.batch
        if batch is not None:
            if busy[lane]:
                raise SimulationError(f"consumer {lane} dispatched with its device busy")
            tok = 0
            for req in batch.requests:
                del waiting[lane][req.payload]
                tok += tokens[req.payload]
            size = len(batch.requests)
            compute = cost.batch_ms(size, tok, now, fleet.factor(lane, now))
            busy[lane] = True
            busy_until_est[lane] = now + (engine.curve.estimate_ms(batch.record.cost) or 0.0)
            sizes.append(size)
            flows[lane].served(now, batch.record.cost)
            push(now + compute, _COMPLETE, lane, (batch, compute))
            return
        if decision.wake_at_ms is not None and not busy[lane]:
            wake_version[lane] += 1
            push(max(decision.wake_at_ms, now + 0.001), _WAKE, lane, wake_version[lane])

    def offer(lane: int, i: int, priority: int, now: float) -> None:
        req = PendingRequest(
            str(i),
            create[i],
            tokens[i] if token_cost else 1,
            priority,
            None if deadline is None else create[i] + deadline,
            i,
        )
        engines[lane].offer(req, now)
        if not forwarded_in[i]:
            flows[lane].offered(now, req.cost)
        waiting[lane][i] = req
        if deadline is not None:  # with deadlines, what is shed on arrival is answered before a scan can pick it
            poll(lane, now)
        if not busy[lane]:
            drive(lane, now)

    def drive(lane: int, now: float) -> None:
        """Poll the free device's engine, forwarding first what a peer would finish sooner (as the
        live consumer does before each poll with a free device slot)."""
        if forwarding and len(waiting[lane]) > 1:
            scan(lane, now)
        if not busy[lane]:
            poll(lane, now)

    def local_view(lane: int, now: float) -> LocalView | None:
        busy_for = max(0.0, busy_until_est[lane] - now) if busy[lane] else 0.0
        return curve_view(engines[lane].curve, busy_for, *flows[lane].rates_per_ms(now))

    def beacon(lane: int, now: float) -> None:
        view = local_view(lane, now)
        if view is not None:
            member = beacon_view(str(lane), now, len(waiting[lane]), view, batch_ms[lane], owned[lane])
            push(now + fleet.hop_ms, _BEACON_SEEN, lane, member)
        push(now + fleet.beacon_interval_ms, _BEACON, lane, None)

    def scan(lane: int, now: float) -> bool:
        """Forward what peers would finish sooner; True when something left."""
        queue = waiting[lane]
        if not queue:
            return False
        view = local_view(lane, now)
        peers = peers_after(str(lane), (m for m in board if m is not None))
        if view is None or not peers:
            return False
        counts, since = sent[lane], sent_since[lane]
        for m in peers:
            if since.get(m.member_id) != m.at_ms:
                since[m.member_id] = m.at_ms
                counts[m.member_id] = 0
        ordered = dispatch_order(queue.values())
        movable = [not forwarded_in[r.payload] for r in ordered]
        plan = plan_forwards(len(ordered), movable, view, peers, now, rule, counts)
        for f in plan:
            req = ordered[f.index]
            i = req.payload
            if forwarded_in[i] or not engines[lane].withdraw(req):
                raise SimulationError(f"consumer {lane} planned to forward request {i}, which it cannot")
            del queue[i]
            forwarded[i] = True
            forwards_out[lane] += 1
            push(now + fleet.hop_ms, _ARRIVE_FORWARD, int(f.member_id), i)
        return bool(plan)

    if forwarding:
        for lane in range(consumers):
            phase = (lane + 0.5) / consumers
            push(phase * fleet.beacon_interval_ms, _BEACON, lane, None)
            push(phase * fleet.scan_interval_ms, _SCAN, lane, None)

    i = 0
    inf = float("inf")
    while answered < n:
        if i >= n and work == 0:
            raise SimulationError(f"{n - answered} requests were never answered")
        t_arr = deliver[i] if i < n else inf
        if heap and heap[0][0] <= t_arr:
            now, _, kind, lane, data = heapq.heappop(heap)
            if kind in (_ARRIVE_FORWARD, _COMPLETE, _WAKE):
                work -= 1
            if kind == _COMPLETE:
                batch, compute = cast(tuple[Batch, float], data)
                busy[lane] = False
                for req in batch.requests:
                    j = req.payload
                    if not np.isnan(done[j]):
                        raise SimulationError(f"request {j} answered twice (consumer {lane})")
                    done[j] = now
                    served_by[j] = lane
                answered += len(batch.requests)
                engines[lane].completed(batch, now, compute)
                batch_ms[lane] = recent_batch_ms(batch_ms[lane], compute, rule)
                drive(lane, now)
            elif kind == _WAKE:
                if data == wake_version[lane] and not busy[lane]:
                    poll(lane, now)
            elif kind == _ARRIVE_FORWARD:
                j = cast(int, data)
                forwarded_in[j] = True
                forwards_in[lane] += 1
                offer(lane, j, 0, now)
            elif kind == _SCAN:
                push(now + fleet.scan_interval_ms, _SCAN, lane, None)
                if scan(lane, now) and not busy[lane]:
                    poll(lane, now)
            elif kind == _BEACON:
                beacon(lane, now)
            else:
                board[lane] = cast(MemberView, data)
            continue
        offer(lane_of[i], i, prio[i], t_arr)
        i += 1

    done_arr = np.asarray(done, dtype=float)
    if np.isnan(done_arr).any() or answered != n:
        raise SimulationError(f"{int(np.isnan(done_arr).sum())} requests were never answered")
    if sum(sizes) + int(sum(expired)) != n:
        raise SimulationError(f"batches hold {sum(sizes)} requests and {int(sum(expired))} expired, but {n} arrived")
    return FleetOutcome(
        arrivals,
        done_arr,
        np.asarray(expired, dtype=bool),
        np.asarray(served_by),
        np.asarray(forwarded, dtype=bool),
        np.asarray(forwards_out),
        np.asarray(forwards_in),
        sizes,
        consumers,
    )
