"""The arrivals a scenario generates: seeded, per-request draws in independent streams.

Common random numbers: request i keeps its draws at every load and every length
of run, so two runs differ only in what they are meant to compare.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.core.sim.fleetspec import partition_owner
from pipeline.core.sim.scenario import Scenario


@dataclass
class Arrivals:
    """One load realisation of a scenario, ordered by delivery to the consumers."""

    create_ms: np.ndarray
    """Record timestamp: waiting is measured from here."""
    deliver_ms: np.ndarray
    """When the request reaches its consumer (create + fetch delay)."""
    tokens: np.ndarray
    priority: np.ndarray
    lane: np.ndarray

    def __len__(self) -> int:
        return int(self.create_ms.shape[0])


class RateProfile:
    """Nominal arrival rate at a time, to split batches into busy and idle periods."""

    def __init__(self, scenario: Scenario) -> None:
        segs = scenario.segments()
        self._starts = [s for s, _, _ in segs]
        self._rates = [r for _, _, r in segs]
        self.mean = scenario.mean_rate_per_s

    def at(self, t_ms: float) -> float:
        i = bisect.bisect_right(self._starts, t_ms) - 1
        return self._rates[max(0, min(i, len(self._rates) - 1))]


DRAW_BLOCK = 4096
"""Per-request draws come in blocks of this many, each block from its own seeded
generator, so request i's draw does not depend on how many requests there are."""

ARRIVAL_STREAM, PROMPT_STREAM, OUTPUT_STREAM, PRIORITY_STREAM, LANE_STREAM = range(5)
"""One independent stream of draws per per-request quantity."""


def stream_draws(seed: int, stream: int, n: int, draw: Any) -> np.ndarray:
    """Draws 0..n-1 of one stream: `draw(rng, size)` per block."""
    blocks = [draw(np.random.default_rng([seed, stream, b]), DRAW_BLOCK) for b in range(-(-n // DRAW_BLOCK))]
    return np.concatenate(blocks)[:n] if blocks else draw(np.random.default_rng(0), 0)


def categorical(seed: int, stream: int, n: int, weights: np.ndarray) -> np.ndarray:
    """Draws 0..n-1 of one stream of indexes into `weights` (not normalised)."""
    p = weights / weights.sum()
    return stream_draws(seed, stream, n, lambda g, k: g.choice(len(p), size=k, p=p))


def arrival_times(scenario: Scenario, multiplier: float) -> np.ndarray:
    """Poisson arrival times at `multiplier` x the nominal rate, by time change: unit-rate
    points on the axis of expected requests (one stream for every load), divided by the
    multiplier and mapped back through the nominal intensity's cumulative curve."""
    segs = [(s, e, r) for s, e, r in scenario.segments() if r > 0 and e > s]
    if not segs or multiplier <= 0:
        return np.zeros(0)
    expected = np.cumsum([0.0] + [(e - s) * r / 1000.0 for s, e, r in segs])
    reach = expected[-1] * multiplier
    n = int(reach + 8 * math.sqrt(reach)) + 16
    while True:
        points = np.cumsum(stream_draws(scenario.seed, ARRIVAL_STREAM, n, lambda g, k: g.standard_exponential(k)))
        if points[-1] >= reach:
            break
        n *= 2
    x = points[points < reach] / multiplier
    seg = np.searchsorted(expected, x, side="right") - 1
    starts = np.array([s for s, _, _ in segs])
    rates = np.array([r for _, _, r in segs])
    times: np.ndarray = starts[seg] + (x - expected[seg]) * 1000.0 / rates[seg]
    return times


def make_arrivals(scenario: Scenario, multiplier: float = 1.0) -> Arrivals:
    """Poisson arrivals at `multiplier` x every rate, from one realisation for every load
    (common random numbers): request i keeps its tokens, priority and lane at any
    multiplier and arrives earlier as the load grows. A heavier load is the same traffic,
    denser, so comparing two loads compares loads, not two draws: on a short scenario
    independent draws made pass/fail at neighbouring loads a coin toss."""
    create = arrival_times(scenario, multiplier)
    n = create.shape[0]
    seed = scenario.seed
    tokens = stream_draws(seed, PROMPT_STREAM, n, scenario.prompt.sample) + stream_draws(
        seed, OUTPUT_STREAM, n, scenario.output.sample
    )
    mix = np.asarray(scenario.priority_mix, dtype=float)
    priority = categorical(seed, PRIORITY_STREAM, n, mix) if len(mix) > 1 else np.zeros(n, dtype=np.int64)
    topo = scenario.topology
    lanes = topo.lanes
    if scenario.fleet is not None:
        fleet = scenario.fleet
        partition = categorical(seed, LANE_STREAM, n, fleet.partition_weights())
        lane = partition_owner(fleet, topo.consumers)[partition]
    elif lanes == 1:
        lane = np.zeros(n, dtype=np.int64)
    elif topo.mode == "shared-device":
        share = np.asarray(topo.model_share or [1.0] * lanes, dtype=float)
        lane = categorical(seed, LANE_STREAM, n, share)
    else:
        weights = np.ones(lanes)
        weights[0] += topo.skew
        if topo.assignment == "random" or topo.skew > 0:
            lane = categorical(seed, LANE_STREAM, n, weights)
        else:
            lane = np.arange(n, dtype=np.int64) % lanes
    deliver = create.copy()
    if topo.fetch_delay_ms > 0 and topo.mode == "own-queues":
        deliver[lane == 0] += topo.fetch_delay_ms
    order = np.argsort(deliver, kind="stable")
    return Arrivals(create[order], deliver[order], tokens[order], priority[order], lane[order])
