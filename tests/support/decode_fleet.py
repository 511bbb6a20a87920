"""Two decode loops on a virtual clock, balanced (or not) by the consumer's own decision code.

A model, not the device: each loop decodes one token for every running row per step, a step taking
`speed x (a + b sqrt(rows))` ms (concave in rows, as SmolLM2's decode step on a CPU core), and a
joiner's prefill adds `speed x (c + d x prompt)` to the step it joins in. Requests arrive Poisson on
four partitions, two per consumer; each consumer keeps a `DecodeLedger` of its own loop (told every
plain step as it ends, unless `timed_steps` is off: then it learns from answers only), publishes
its `DecodeState` every 100 ms (seen one hop later) and places every waiting request with
`plan_decode_forwards`; a forward reaches its peer one hop later and never moves again. What the
tests read: per request its first and last token and who answered it, and the forwards.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from pipeline.core.engine.decode_forwarding import DecodeLedger, DecodePeer, DecodeRule, plan_decode_forwards

HOP_MS = 10.0
BEACON_MS = 100.0


@dataclass
class _Request:
    rid: int
    arrive_ms: float
    prompt: int
    tokens: int
    forwarded: bool = False
    first_ms: float = math.nan
    last_ms: float = math.nan
    served_by: int = -1
    left: int = 0


@dataclass
class _Loop:
    index: int
    speed: float
    slots: int
    ledger: DecodeLedger = field(init=False)
    queue: list[_Request] = field(default_factory=list)
    joining: list[_Request] = field(default_factory=list)
    running: list[_Request] = field(default_factory=list)
    stepping: bool = False
    plain: tuple[int, float] | None = None
    """The step under way, (rows, ms), when it carries no prefill (the loop times it)."""
    beacon: DecodePeer | None = None
    """The peer's newest beacon as this loop has heard it."""

    def __post_init__(self) -> None:
        self.ledger = DecodeLedger(self.slots)

    def step_ms(self, rows: int) -> float:
        return self.speed * (40.0 + 12.0 * math.sqrt(max(1, rows)))

    def prefill_ms(self, prompt: int) -> float:
        return self.speed * (30.0 + 1.5 * prompt)


@dataclass
class FleetRun:
    requests: list[_Request]
    forwarded: int

    def p99(self, what: str) -> float:
        values = [getattr(r, what) - r.arrive_ms for r in self.requests]
        return float(np.percentile(values, 99))

    @property
    def forwarded_share(self) -> float:
        return self.forwarded / len(self.requests)

    def served(self, index: int) -> int:
        return sum(1 for r in self.requests if r.served_by == index)


def run_fleet(
    speeds: tuple[float, float],
    rate_per_s: float,
    duration_s: float,
    *,
    balance: bool,
    seed: int = 1,
    slots: int = 32,
    slowdown: tuple[float, float] | None = None,
    timed_steps: bool = True,
) -> FleetRun:
    """Serve `duration_s` of Poisson arrivals at `rate_per_s` on two loops of `speeds` (1.0: the
    reference device; 2.0 twice as slow); `slowdown` (from_s, to_s): loop 0 twice as slow over that span;
    `timed_steps`: each ledger is told every plain step as it ends (as a consumer's decode loop does)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1000.0 / rate_per_s, size=int(rate_per_s * duration_s * 1.2)))
    arrivals = arrivals[arrivals < duration_s * 1000.0]
    requests = [
        _Request(i, float(t), int(rng.integers(10, 40)), int(rng.integers(8, 129))) for i, t in enumerate(arrivals)
    ]
    owner = rng.integers(0, 4, size=len(requests)) // 2
    loops = [_Loop(0, speeds[0], slots), _Loop(1, speeds[1], slots)]
    rule = DecodeRule(hop_ms=HOP_MS)
    sent: list[dict[str, int]] = [{}, {}]
    events: list[tuple[float, int, str, int, int]] = []
    order = 0

    def push(at: float, kind: str, loop: int, rid: int = -1) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, loop, rid))

    for r, o in zip(requests, owner, strict=True):
        push(r.arrive_ms, "arrive", int(o), r.rid)
    for k in range(int(duration_s * 1000.0 / BEACON_MS) * 4):  # beacons until well after the last arrival
        for index in (0, 1):
            push(k * BEACON_MS, "beacon", index)
    forwarded = 0

    def slowed(loop: _Loop, now: float) -> float:
        if slowdown is not None and loop.index == 0 and slowdown[0] * 1000.0 <= now < slowdown[1] * 1000.0:
            return 2.0
        return 1.0

    def place(loop: _Loop, now: float) -> None:
        nonlocal forwarded
        peer = loop.beacon
        room = loop.slots - len(loop.running) - len(loop.joining)
        if balance and peer is not None and loop.queue:
            plan = plan_decode_forwards(
                [r.tokens for r in loop.queue],
                [not r.forwarded for r in loop.queue],
                loop.ledger.local(now, room),
                [peer],
                now,
                rule,
                sent[loop.index],
            )
            leaving = {f.index for f in plan}
            for k in sorted(leaving):
                request = loop.queue[k]
                request.forwarded = True
                forwarded += 1
                push(now + HOP_MS, "arrive", 1 - loop.index, request.rid)
            loop.queue = [r for k, r in enumerate(loop.queue) if k not in leaving]
        while loop.queue and room > 0:
            request = loop.queue.pop(0)
            loop.ledger.dispatched(str(request.rid), now, 128)
            loop.joining.append(request)
            room -= 1
        if not loop.stepping and (loop.joining or loop.running):
            start_step(loop, now)

    def start_step(loop: _Loop, now: float) -> None:
        factor = slowed(loop, now)
        joined, loop.joining = loop.joining, []
        took = factor * (loop.step_ms(len(loop.running) + len(joined)) if loop.running else 0.0)
        took += factor * sum(loop.prefill_ms(r.prompt) for r in joined)
        for r in joined:
            r.left = r.tokens
            r.first_ms = -1.0  # stamped when this step ends
        loop.plain = (len(loop.running), took) if loop.running and not joined else None
        loop.running += joined
        loop.stepping = True
        push(now + took, "stepped", loop.index)

    beacons: dict[int, DecodePeer] = {}
    while events:
        now, key, kind, index, rid = heapq.heappop(events)
        loop = loops[index]
        if kind == "arrive":
            loop.queue.append(requests[rid])
            place(loop, now)
        elif kind == "beacon":
            room = loop.slots - len(loop.running) - len(loop.joining)
            beacons[key] = DecodePeer(
                str(index), now, (2 * index, 2 * index + 1), loop.ledger.state(now, room, len(loop.queue))
            )
            push(now + HOP_MS, "heard", 1 - index, key)
        elif kind == "heard":
            loop.beacon = beacons.pop(rid)
            sent[index].pop(loop.beacon.member_id, None)
        elif kind == "stepped":
            loop.stepping = False
            if timed_steps and loop.plain is not None:
                loop.ledger.stepped(*loop.plain)
            for r in loop.running:
                if r.first_ms < 0:
                    r.first_ms = now
                r.left -= 1
                if r.left <= 0:
                    r.last_ms, r.served_by = now, index
                    loop.ledger.answered(str(r.rid), now, r.first_ms, r.last_ms, r.tokens)
            loop.running = [r for r in loop.running if r.left > 0]
            place(loop, now)
    unanswered = [r.rid for r in requests if math.isnan(r.last_ms)]
    assert not unanswered, f"{len(unanswered)} requests never ended"
    return FleetRun(requests, forwarded)
