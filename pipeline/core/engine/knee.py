"""Where a larger batch stops paying, and where it stops fitting the compute budget.

Knee: a larger batch counts as better only if it raises throughput by more
than `knee_tolerance` per doubling of the size. Taking logs, the knee is the
smallest observed size maximising

    g(b) = log(b / (t(b) + o)) - log2(b) * log(1 + knee_tolerance)

where o is the driver's per-batch overhead outside the device
(`batch_overhead_ms`: producing results and events, the thread hop), in one
pass over the measured points. Measured times are noisy (token mixes, a
shared GPU), so a size scoring within the noise (the median spread of log t
inside the buckets) of the best is not worse: the cap reaches the largest
such size. The cap is the knee only when there is evidence: a larger size
was observed and was not better. Throughput still rising at the largest
observed size says nothing about bigger ones, so the cap ramps instead
(twice the largest size seen). Sizes whose t(b) passes the compute budget
are never candidates for the latency cap.
"""

from __future__ import annotations

import math


class KneeScore:
    """log throughput, less the tolerance per doubling: the knee maximises it.

    Throughput counts the driver's per-batch overhead too: a model that
    computes in microseconds is limited by that overhead, not by t(b).
    """

    def __init__(self, knee_tolerance: float, overhead_ms: float) -> None:
        self._doubling_penalty = math.log(1.0 + knee_tolerance) / math.log(2.0)
        self._overhead_ms = overhead_ms

    def __call__(self, size: int, time_ms: float) -> float:
        return math.log(size / (time_ms + self._overhead_ms)) - self._doubling_penalty * math.log(size)


def knee_cap(
    points: list[tuple[int, float]], score: KneeScore, noise: float, evidence: int, start_cap: int
) -> tuple[int, str]:
    """The cap the measured curve supports (before hard_cap), and why: `knee` or `ramp`.

    `evidence` is the largest size measured often enough for "not better" to lower the cap."""
    best_g = -math.inf
    for s, t in points:
        g = score(s, t)
        if g > best_g:
            best_g = g
    reach = max(s for s, t in points if score(s, t) >= best_g - noise)
    largest = points[-1][0]
    if reach < min(largest, evidence):
        return reach, "knee"
    if reach < largest:
        return largest, "knee"  # not better once: measure it again before moving
    return max(start_cap, 2 * largest), "ramp"


def budget_cap(points: list[tuple[int, float]], budget_ms: float | None, hard_cap: int) -> int:
    """Largest size whose t(b) stays within the compute budget (hard_cap if all do)."""
    if budget_ms is None:
        return hard_cap
    over = [(s, t) for s, t in points if t > budget_ms]
    if not over:
        return hard_cap
    first_over, t_over = over[0]
    under = [(s, t) for s, t in points if s < first_over]
    # The size where t(b) crosses the budget, interpolated between the last
    # measured size under it and the first over it (from 0 ms at size 0 when
    # none is under): unmeasured sizes in between count.
    s_under, t_under = under[-1] if under else (0, 0.0)
    return max(1, s_under + math.floor((first_over - s_under) * (budget_ms - t_under) / (t_over - t_under)))
