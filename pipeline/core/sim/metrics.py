"""What one simulated run measured: the row of the policy bench.

Latency percentiles are over served requests; expired requests are answered
too (counted in `expired_share`) but have no compute latency. For the SLO test
an expired request counts as a miss. Goodput counts the requests answered `ok`
within the SLO, per second of the arrival span (the same for every policy on
one load, so goodput ratios are ratios of requests served in time).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from pipeline.core.sim.arrivals import RateProfile
from pipeline.core.sim.scenario import Scenario
from pipeline.core.sim.simulator import RunOutcome


@dataclass
class RunMetrics:
    requests: int
    throughput_rps: float
    throughput_tokens_per_s: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    queue_wait_p99_ms: float
    share_wait_over_1s: float
    hit_ratio: float
    hit_ratio_busy: float
    hit_ratio_idle: float
    mean_batch_size: float
    marked_share: float
    marked_p99_ms: float
    unmarked_p99_ms: float
    expired_share: float
    slo_miss_share: float
    goodput_rps: float
    """Requests served within the SLO per second of the arrival span."""
    good_share: float
    """Share of all requests served within the SLO."""

    def as_dict(self) -> dict[str, float | None]:
        """The figures by name, NaN (no sample) as None: JSON has no NaN."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def _ratio(flags: np.ndarray) -> float:
    return float(flags.mean()) if flags.size else float("nan")


def measure(scenario: Scenario, outcome: RunOutcome) -> RunMetrics:
    arr = outcome.arrivals
    served = ~outcome.expired & ~np.isnan(outcome.done_ms)
    latency = (outcome.done_ms - arr.create_ms)[served]
    wait = (outcome.dispatch_ms - arr.create_ms)[served]
    marked = outcome.marked[served]
    n = outcome.requests
    span_s = max(1e-9, (np.nanmax(outcome.done_ms) - float(arr.create_ms.min())) / 1000.0) if n else 1.0
    sizes = np.asarray(outcome.batches.size, dtype=float)
    hits = np.asarray(outcome.batches.hit_target, dtype=bool)
    rates = RateProfile(scenario)
    busy = np.asarray([rates.at(t) >= rates.mean for t in outcome.batches.dispatch_ms], dtype=bool)
    misses = int(outcome.expired.sum()) + int((latency > scenario.slo_p99_ms).sum())
    good = int((latency <= scenario.slo_p99_ms).sum())
    arrival_s = max(1e-9, float(arr.create_ms.max() - arr.create_ms.min()) / 1000.0) if n else 1.0
    return RunMetrics(
        requests=n,
        throughput_rps=float(served.sum()) / span_s,
        throughput_tokens_per_s=float(arr.tokens[served].sum()) / span_s,
        p50_ms=_pct(latency, 50),
        p99_ms=_pct(latency, 99),
        p999_ms=_pct(latency, 99.9),
        queue_wait_p99_ms=_pct(wait, 99),
        share_wait_over_1s=_ratio(wait > 1000.0),
        hit_ratio=_ratio(hits),
        hit_ratio_busy=_ratio(hits[busy]),
        hit_ratio_idle=_ratio(hits[~busy]),
        mean_batch_size=float(sizes.mean()) if sizes.size else float("nan"),
        marked_share=_ratio(marked),
        marked_p99_ms=_pct(latency[marked], 99),
        unmarked_p99_ms=_pct(latency[~marked], 99),
        expired_share=_ratio(outcome.expired),
        slo_miss_share=misses / n if n else 0.0,
        goodput_rps=good / arrival_s,
        good_share=good / n if n else 0.0,
    )


def slo_budget(requests: int) -> int:
    """Most SLO misses a run may have and still keep p99 <= SLO (1% of all answers)."""
    return math.floor(0.01 * requests)
