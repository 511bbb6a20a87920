"""What a generation run measured: end-to-end percentiles, throughput, TTFT and TPOT of the served requests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.core.sim.generation.decode_loop import GenOutcome


@dataclass(frozen=True)
class GenFigures:
    """What a generation run measured (served requests; expired ones are counted apart)."""

    requests: int
    served: int
    p50_ms: float
    p99_ms: float
    throughput_rps: float
    generated_tokens_per_s: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    expired_share: float
    mean_rows: float


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def gen_figures(outcome: GenOutcome, tokens_out: np.ndarray, overhead_ms: float = 0.0) -> GenFigures:
    """End-to-end percentiles (plus `overhead_ms`, the hops outside the device), throughput over the
    first record to the last answer, TTFT and TPOT p99 of the served requests."""
    arr = outcome.arrivals
    served = ~outcome.expired & ~np.isnan(outcome.done_ms)
    e2e = (outcome.done_ms - arr.create_ms)[served] + overhead_ms
    span_s = max(1e-9, (float(np.nanmax(outcome.done_ms)) - float(arr.create_ms.min())) / 1000.0) if len(arr) else 1.0
    ttft = (outcome.first_ms - arr.create_ms)[served]
    many = served & (tokens_out > 1)
    tpot = (outcome.done_ms - outcome.first_ms)[many] / (tokens_out[many] - 1)
    return GenFigures(
        requests=len(arr),
        served=int(served.sum()),
        p50_ms=_pct(e2e, 50),
        p99_ms=_pct(e2e, 99),
        throughput_rps=float(served.sum()) / span_s,
        generated_tokens_per_s=float(tokens_out[served].sum()) / span_s,
        ttft_p99_ms=_pct(ttft, 99),
        tpot_p99_ms=_pct(tpot, 99),
        expired_share=float(outcome.expired.mean()) if len(arr) else 0.0,
        mean_rows=float(np.mean(outcome.step_rows)) if outcome.step_rows else 0.0,
    )
