"""A scenario: the traffic, device and layout one benchmark runs.

A scenario says how requests arrive (Poisson phases with optional periodic
bursts), how long they are (prompt/output token distributions), what the
device costs (t(b)), how consumers and devices are laid out, the client
priority mix, and the SLO. Its file is read and validated by
`scenario_file.py` (the format: docs/benchmarks.md); the arrivals it generates
come from `arrivals.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from pipeline.core.sim.device_curve import CostModel
from pipeline.core.sim.fleetspec import FleetSpec

TopologyMode = Literal["own-queues", "shared-queue", "shared-device"]


class ScenarioError(ValueError):
    """A scenario file a user must fix; the message names the file and the key."""


@dataclass(frozen=True)
class Burst:
    every_s: float
    duration_s: float
    rate_per_s: float
    offset_s: float = 0.0


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate_per_s: float
    bursts: Burst | None = None


@dataclass(frozen=True)
class LengthDist:
    """Token count distribution: fixed, uniform [min, max] or lognormal (median, sigma) clipped."""

    dist: Literal["fixed", "uniform", "lognormal"] = "fixed"
    value: int = 0
    min: int = 0
    max: int = 0
    median: float = 0.0
    sigma: float = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(self.min, self.max + 1, size=n, dtype=np.int64)
        raw = rng.lognormal(np.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(raw), self.min, self.max).astype(np.int64)

    def mean(self) -> float:
        sample = self.sample(np.random.default_rng(0), 20000)
        return float(sample.mean())


@dataclass(frozen=True)
class Topology:
    mode: TopologyMode = "own-queues"
    consumers: int = 1
    """own-queues: consumers with one queue and one device each; shared-queue: devices
    behind one queue; shared-device: models (one queue each) sharing one device."""
    assignment: Literal["round-robin", "random"] = "round-robin"
    skew: float = 0.0
    """own-queues: consumer 0 gets (1 + skew) times the share of every other consumer."""
    fetch_delay_ms: float = 0.0
    """own-queues: consumer 0's records reach it this late (its partition lags)."""
    model_share: tuple[float, ...] = ()
    model_cost_scale: tuple[float, ...] = ()

    @property
    def lanes(self) -> int:
        """Number of queues (one policy object each)."""
        return 1 if self.mode == "shared-queue" else self.consumers

    @property
    def devices(self) -> int:
        return 1 if self.mode == "shared-device" else self.consumers

    def lane_devices(self, lane: int) -> list[int]:
        if self.mode == "own-queues":
            return [lane]
        if self.mode == "shared-queue":
            return list(range(self.consumers))
        return [0]

    def lane_cost_scale(self, lane: int) -> float:
        if self.mode == "shared-device" and self.model_cost_scale:
            return self.model_cost_scale[lane]
        return 1.0


@dataclass(frozen=True)
class Scenario:
    name: str
    phases: tuple[Phase, ...]
    cost: CostModel
    seed: int = 1
    description: str = ""
    slo_p99_ms: float = 1000.0
    prompt: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=32))
    output: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=0))
    topology: Topology = field(default_factory=Topology)
    priority_mix: tuple[float, ...] = (1.0,)
    deadline_ms: float | None = None
    fleet: FleetSpec | None = None
    """A consumer group studied by `bench fleet` (partitions, device speeds, forwarding)."""
    source: str = "<scenario>"

    @property
    def duration_ms(self) -> float:
        return 1000.0 * sum(p.duration_s for p in self.phases)

    def segments(self) -> list[tuple[float, float, float]]:
        """(start_ms, end_ms, rate_per_s) pieces of constant nominal rate, bursts included."""
        out: list[tuple[float, float, float]] = []
        start = 0.0
        for ph in self.phases:
            end = start + ph.duration_s * 1000.0
            bursts: list[tuple[float, float, float]] = []
            if ph.bursts is not None:
                b = ph.bursts
                t = start + b.offset_s * 1000.0
                while t < end:
                    bursts.append((t, min(end, t + b.duration_s * 1000.0), b.rate_per_s))
                    t += b.every_s * 1000.0
            cursor = start
            for b0, b1, rate in bursts:
                if b0 > cursor:
                    out.append((cursor, b0, ph.rate_per_s))
                out.append((b0, b1, rate))
                cursor = b1
            if cursor < end:
                out.append((cursor, end, ph.rate_per_s))
            start = end
        return out

    @property
    def mean_rate_per_s(self) -> float:
        segs = self.segments()
        return sum((e - s) * r for s, e, r in segs) / max(1e-9, sum(e - s for s, e, _ in segs))

    def mean_tokens(self) -> float:
        return self.prompt.mean() + self.output.mean()
