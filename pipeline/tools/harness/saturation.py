"""Every model of a running pipeline kept busy at the same time, within its objective, and when its
answers came back.

One closed-loop client per model holds requests in flight: the model's queue
never runs dry, whatever its speed on this machine, and when the clients stop
only that many requests are left to drain. How many it holds follows the
answers (`InFlightControl`): as many as the model answers within its objective,
so the rate measured is what the model serves within the objective, not a rate
bought with answers nobody waits for. All models are driven at once, so each
one answers at the rate it serves while the others, the broker and the sink
take their share of the machine: what the machine serves with everything
running, measured rather than assumed. The requests are tagged as warm-up
traffic, so reports leave them out of every figure.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from pipeline.core.config import KafkaSettings
from pipeline.tools.devtools.producer import Load, LoadProducer
from pipeline.tools.harness.results import ResultArrivals

TARGET = 0.9
"""The p90 of a round's answers the depth aims at, as a share of the objective."""
HOLD_BELOW = 0.7
"""A round whose p90 lies within [HOLD_BELOW, 1] x the objective keeps the depth."""
ROUND_ANSWERS = 4
"""Answers a round takes at least (and half the depth)."""


class InFlightControl:
    """How many requests a closed-loop client keeps in flight: as many as its model answers within
    `objective_ms`. After a change it waits for answers to requests sent since (they alone show the
    new depth), then scales the depth by TARGET x objective / their p90: at a busy model an answer
    waits behind the requests ahead of it, so its time grows with the depth (Little's law). A step
    at most halves or doubles the depth, within [1, most]. Pure: every time is an argument."""

    def __init__(self, start: int, most: int, objective_ms: float) -> None:
        if objective_ms <= 0 or most < 1:
            raise ValueError("the objective must be > 0 and the most in flight >= 1")
        self.depth = max(1, min(start, most))
        self.most = most
        self.objective_ms = objective_ms
        self._since_ms = -math.inf
        self._round: list[float] = []
        self.rounds: list[tuple[int, float]] = []
        """(depth, p90 ms) of every round ended."""

    def answered(self, sent_ms: float, answered_ms: float) -> None:
        """One answer came back: it counts toward the round if it was sent since the last change."""
        if sent_ms < self._since_ms:
            return
        self._round.append(answered_ms - sent_ms)
        if len(self._round) >= max(ROUND_ANSWERS, self.depth // 2):
            self._end_round(answered_ms)

    def _end_round(self, now_ms: float) -> None:
        p90 = float(np.quantile(self._round, 0.9))
        self.rounds.append((self.depth, p90))
        self._round = []
        if HOLD_BELOW * self.objective_ms <= p90 <= self.objective_ms:
            return
        scaled = round(self.depth * TARGET * self.objective_ms / max(p90, 1e-3))
        bounded = min(max(scaled, math.ceil(self.depth / 2)), 2 * self.depth)
        depth = min(max(bounded, 1), self.most)
        if depth != self.depth:
            self.depth = depth
            self._since_ms = now_ms


@dataclass(frozen=True)
class Drive:
    """One model's closed-loop client."""

    model: str
    pool: Load
    """The requests it sends, in order (prompt lengths, priorities, new tokens); reused from the start
    when it runs out."""
    in_flight: int
    """Requests it keeps sent and unanswered at first."""
    most_in_flight: int
    objective_ms: float
    """An answer's end-to-end objective: the depth follows what keeps the answers within it."""
    seed: int = 0


@dataclass(frozen=True)
class Driven:
    """What one model's client saw."""

    sent: int
    answers_ms: list[float]
    """Wall-clock epoch ms each answer came back, in order (every outcome)."""
    not_ok: int
    unanswered: int
    """Requests still unanswered when the drain gave up."""
    rounds: list[tuple[int, float]]
    """(requests in flight, p90 of the answers ms) of every round of the depth's control."""


def _take(pool: Load, start: int, count: int) -> Load:
    index = (np.arange(start, start + count) % len(pool)).astype(np.int64)
    return replace(
        pool,
        send_ms=np.zeros(count),
        tokens=pool.tokens[index],
        priority=pool.priority[index],
        partition=None,
        new_tokens=None if pool.new_tokens is None else pool.new_tokens[index],
    )


async def _drive(
    settings: KafkaSettings,
    drive: Drive,
    until: float,
    drain_s: float,
    stop: Callable[[], bool],
    run_id: str,
) -> Driven:
    arrivals = ResultArrivals(settings, drive.model)
    control = InFlightControl(drive.in_flight, drive.most_in_flight, drive.objective_ms)
    await arrivals.start()
    try:
        async with LoadProducer(settings, drive.model, run_id=run_id, seed=drive.seed) as producer:
            pending: set[str] = set()
            sent = rounds = 0
            while time.monotonic() < until and not stop():
                done = {rid for rid in pending if rid in arrivals.received_ms}
                for rid in sorted(done, key=lambda r: arrivals.received_ms[r]):
                    control.answered(producer.sent_ms[rid], arrivals.received_ms[rid])
                pending -= done
                want = control.depth - len(pending)
                if want > 0:
                    before = set(producer.sent_ms)
                    await producer.send(_take(drive.pool, sent, want), tag=f"r{rounds}-", warmup=True)
                    pending |= set(producer.sent_ms) - before
                    sent += want
                    rounds += 1
                await asyncio.sleep(0.02)
            ids = list(producer.sent_ms)
            await arrivals.wait_until(
                lambda: stop() or all(rid in arrivals.received_ms for rid in ids), timeout_s=drain_s, poll_s=0.1
            )
            answered = [rid for rid in ids if rid in arrivals.received_ms]
            return Driven(
                sent=len(ids),
                answers_ms=sorted(arrivals.received_ms[rid] for rid in answered),
                not_ok=sum(arrivals.outcomes[rid] != "ok" for rid in answered),
                unanswered=len(ids) - len(answered),
                rounds=control.rounds,
            )
    finally:
        await arrivals.stop()


async def drive_together(
    settings: KafkaSettings,
    drives: list[Drive],
    seconds: float,
    *,
    drain_s: float = 120.0,
    stop: Callable[[], bool] = lambda: False,
    run_id: str = "calibrate",
) -> tuple[float, float, dict[str, Driven]]:
    """Drive every model at once for `seconds`, then wait (at most `drain_s`) for what is left to be
    answered; `stop` cuts both short (a process died). Returns the epoch ms the drive started and
    stopped sending, and what each model's client saw."""
    started = time.time() * 1000.0
    until = time.monotonic() + seconds
    results = await asyncio.gather(*(_drive(settings, d, until, drain_s, stop, run_id) for d in drives))
    ended = started + seconds * 1000.0
    return started, ended, {d.model: r for d, r in zip(drives, results, strict=True)}
