"""Capacity at SLO and the per-family grid search, one procedure for every policy.

Load multipliers live on a geometric ladder m_k = 1.02**k. A policy passes at
m_k when at most 1% of the requests of that load miss the SLO (served later than
`slo_p99_ms`, or expired): that is p99 <= SLO. capacity_at_slo is the largest
passing m_k, found by exponential then binary search over k (assuming more load
never helps). The best config of a family is the one with the highest capacity,
ties broken by lower p99 at the nominal load (m = 1). A config is first tested
at the best capacity found so far in its family: if it fails there it cannot
win, and its exact capacity is not needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.core.engine.decisions import BatchPolicy
from pipeline.core.sim.arrivals import Arrivals, make_arrivals
from pipeline.core.sim.families import DEFAULT_DEVICE_CAP, Builder, Config, LaneContext, builder
from pipeline.core.sim.metrics import RunMetrics, measure, slo_budget
from pipeline.core.sim.scenario import Scenario
from pipeline.core.sim.simulator import RunOutcome, simulate

STEP = 1.02
K_MIN = -200
K_MAX = 250
NO_CAPACITY = K_MIN - 1


def multiplier(k: int) -> float:
    return STEP**k


@dataclass
class Candidate:
    """A family name and one config of its knobs (picklable: the builder is looked up by name)."""

    family: str
    config: Config

    @property
    def build(self) -> Builder:
        return builder(self.family)

    @property
    def key(self) -> str:
        return f"{self.family}:{json.dumps(self.config, sort_keys=True)}"


@dataclass
class Evaluation:
    candidate: Candidate
    capacity_k: int
    nominal: RunMetrics
    outcome: RunOutcome

    @property
    def capacity_at_slo(self) -> float:
        return 0.0 if self.capacity_k <= NO_CAPACITY else multiplier(self.capacity_k)


@dataclass
class Evaluator:
    """Runs candidates on one scenario, caching arrivals per load and pass/fail per (candidate, load)."""

    scenario: Scenario
    on_run: Callable[[], None] | None = None
    arrivals: dict[int, Arrivals] = field(default_factory=dict)
    verdicts: dict[tuple[str, int], bool] = field(default_factory=dict)
    nominal_runs: dict[str, tuple[RunMetrics, RunOutcome | None]] = field(default_factory=dict)
    capacities: dict[str, int] = field(default_factory=dict)
    load_metrics: dict[tuple[str, int], RunMetrics] = field(default_factory=dict)
    runs: int = 0
    requests_simulated: int = 0
    sim_seconds: float = 0.0
    _mean_tokens: float | None = None

    def load(self, k: int) -> Arrivals:
        if k not in self.arrivals:
            if len(self.arrivals) > 24:
                self.arrivals.pop(next(iter(self.arrivals)))
            self.arrivals[k] = make_arrivals(self.scenario, multiplier(k))
        return self.arrivals[k]

    def policies(self, cand: Candidate) -> list[BatchPolicy]:
        topo = self.scenario.topology
        levels = len(self.scenario.priority_mix)
        cost = self.scenario.cost
        device_cap = cost.max_batch or DEFAULT_DEVICE_CAP
        if self._mean_tokens is None:
            self._mean_tokens = self.scenario.mean_tokens()
        return [
            cand.build(
                cand.config,
                LaneContext(
                    len(topo.lane_devices(lane)),
                    max(1, levels),
                    device_cap,
                    cost.profile_points(device_cap, self._mean_tokens, topo.lane_cost_scale(lane)),
                    self.scenario.slo_p99_ms if self.scenario.deadline_ms is not None else None,
                ),
            )
            for lane in range(topo.lanes)
        ]

    def _run(self, cand: Candidate, k: int, abort: bool) -> RunOutcome:
        arrivals = self.load(k)
        outcome = simulate(self.scenario, arrivals, self.policies(cand), slo_budget(len(arrivals)) if abort else None)
        self.runs += 1
        self.requests_simulated += outcome.offered
        self.sim_seconds += outcome.wall_s
        if self.on_run:
            self.on_run()
        return outcome

    def passes(self, cand: Candidate, k: int) -> bool:
        key = (cand.key, k)
        if key not in self.verdicts:
            outcome = self._run(cand, k, abort=True)
            self.verdicts[key] = not outcome.aborted and outcome.over_slo <= slo_budget(outcome.requests)
        return self.verdicts[key]

    def compact(self) -> None:
        """Forget cached arrivals and run outcomes (keep verdicts and metrics) before shipping
        the evaluator to another process."""
        self.arrivals.clear()
        self.on_run = None
        self.nominal_runs = {k: (m, None) for k, (m, _) in self.nominal_runs.items()}

    def nominal(self, cand: Candidate) -> tuple[RunMetrics, RunOutcome | None]:
        if cand.key not in self.nominal_runs:
            outcome = self._run(cand, 0, abort=False)
            self.nominal_runs[cand.key] = (measure(self.scenario, outcome), outcome)
            self.verdicts[(cand.key, 0)] = outcome.over_slo <= slo_budget(outcome.requests)
        return self.nominal_runs[cand.key]

    def at_load(self, cand: Candidate, k: int) -> RunMetrics:
        """Metrics of a full run at load m_k (the nominal run's at k = 0), cached."""
        if k == 0:
            return self.nominal(cand)[0]
        key = (cand.key, k)
        if key not in self.load_metrics:
            self.load_metrics[key] = measure(self.scenario, self._run(cand, k, abort=False))
        return self.load_metrics[key]

    def capacity(self, cand: Candidate, at_least: int | None = None) -> int | None:
        """Largest passing k; None when `at_least` is given and the candidate fails there."""
        if cand.key in self.capacities:
            k = self.capacities[cand.key]
            return None if at_least is not None and k < at_least else k
        if at_least is not None and at_least > NO_CAPACITY:
            if not self.passes(cand, at_least):
                return None
            lo, hi = at_least, None
            if at_least < K_MAX and not self.passes(cand, at_least + 1):
                hi = at_least + 1
        elif self.passes(cand, 0):
            lo, hi = 0, None
        else:
            lo, hi = None, 0
        step = 8
        while lo is not None and hi is None:
            k = min(K_MAX, lo + step)
            if k == lo:
                break
            if self.passes(cand, k):
                lo = k
                step *= 2
            else:
                hi = k
        while lo is None:
            assert hi is not None, "a search with no passing load starts from a failing one"
            k = max(K_MIN, hi - step)
            if self.passes(cand, k):
                lo = k
            elif k == K_MIN:
                lo = NO_CAPACITY
            else:
                hi = k
                step *= 2
        if hi is not None:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self.passes(cand, mid):
                    lo = mid
                else:
                    hi = mid
        self.capacities[cand.key] = lo
        return lo

    def evaluate(self, cand: Candidate) -> Evaluation:
        k = self.capacity(cand)
        assert k is not None
        metrics, outcome = self.nominal(cand)
        if outcome is None:
            outcome = self._run(cand, 0, abort=False)
            self.nominal_runs[cand.key] = (metrics, outcome)
        return Evaluation(cand, k, metrics, outcome)

    def best_of(self, cands: list[Candidate]) -> Evaluation:
        """Highest capacity_at_slo, ties broken by lower p99 at nominal load."""
        best: Candidate | None = None
        best_k = NO_CAPACITY - 1
        for cand in cands:
            k = self.capacity(cand, best_k if best is not None else None)
            if k is None:
                continue
            if k > best_k:
                best, best_k = cand, k
            elif k == best_k and best is not None:
                if _p99(self.nominal(cand)[0]) < _p99(self.nominal(best)[0]):
                    best = cand
        assert best is not None
        return self.evaluate(best)


def _p99(m: RunMetrics) -> float:
    return math.inf if math.isnan(m.p99_ms) else m.p99_ms
