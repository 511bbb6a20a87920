"""What one simulated fleet run measured: the group's latency and who carried it.

Latency is end to end in the simulator's terms (record time to batch
completion) over served requests; a consumer's p99 and share are over the
requests its device served, forwards it received included.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pipeline.core.sim.consumer_group import FleetOutcome
from pipeline.core.sim.scenario import Scenario

RECOVERY_S = 15.0
"""After a slowdown ends, the group's p99 should be back to normal within this long."""


@dataclass
class ConsumerMetrics:
    consumer: int
    factor: float
    """Its device's steady t(b) multiplier (1 = fast)."""
    p99_ms: float
    share: float
    """Share of all requests its device served."""
    forwards_out: int
    forwards_in: int


@dataclass
class FleetMetrics:
    requests: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    forwarded_share: float
    expired_share: float
    mean_batch_size: float
    recovered_p99_ms: float | None
    """p99 of requests recorded from RECOVERY_S after the last slowdown ends to the end of the
    run (None without a slowdown, or when the run ends sooner)."""
    consumers: list[ConsumerMetrics]

    def as_dict(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:
            if isinstance(v, float) and math.isnan(v):
                return None
            if isinstance(v, list):
                return [clean(x) for x in v]
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return v

        cleaned: dict[str, Any] = clean(asdict(self))
        return cleaned


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def measure_fleet(scenario: Scenario, outcome: FleetOutcome) -> FleetMetrics:
    fleet = scenario.fleet
    assert fleet is not None
    create = outcome.arrivals.create_ms
    served = ~outcome.expired
    latency = outcome.done_ms - create
    n = len(create)
    recovered = None
    if fleet.slowdowns:
        since = max(w.to_ms for w in fleet.slowdowns) + RECOVERY_S * 1000.0
        late = served & (create >= since)
        recovered = _pct(latency[late], 99) if late.any() else None
    per = []
    for c in range(outcome.consumers):
        mine = outcome.served_by == c
        per.append(
            ConsumerMetrics(
                consumer=c,
                factor=fleet.steady_factor(c),
                p99_ms=_pct(latency[mine], 99),
                share=float(mine.mean()) if n else 0.0,
                forwards_out=int(outcome.forwards_out[c]),
                forwards_in=int(outcome.forwards_in[c]),
            )
        )
    sizes = np.asarray(outcome.batch_sizes, dtype=float)
    return FleetMetrics(
        requests=n,
        p50_ms=_pct(latency[served], 50),
        p99_ms=_pct(latency[served], 99),
        p999_ms=_pct(latency[served], 99.9),
        forwarded_share=float(outcome.forwarded.mean()) if n else 0.0,
        expired_share=float(outcome.expired.mean()) if n else 0.0,
        mean_batch_size=float(sizes.mean()) if sizes.size else float("nan"),
        recovered_p99_ms=recovered,
        consumers=per,
    )
