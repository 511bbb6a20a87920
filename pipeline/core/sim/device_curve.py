"""The simulated device, modelled once: what a batch costs, t(b), on a device that computes nothing.

The simulator charges every dispatched batch t(size) (cost unit `requests`) or
t(total tokens) (cost unit `tokens`), optionally switching to a second, heavier
curve at `shift_at_ms` ("a heavier model shipped"). The cost-model runner
(consumers/runners/cost_model.py) sleeps the same `DeviceCurve`, so a live
run and its simulation charge a batch the same time. Not to be confused with
the engine's `CostCurve` (pipeline/core/engine/costcurve.py), which learns t(b)
from what a device did.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pipeline.core.config import CostUnit


@dataclass(frozen=True)
class DeviceCurve:
    """One t(x) curve: `a_ms + c_ms * x` (never below 0), or linear interpolation of `points`.

    Beyond the last measured point the last segment's slope continues; below
    the first point the first segment's slope is used, never below 1% of t at
    the first point: a device never computes a batch for free.
    """

    a_ms: float = 0.0
    c_ms: float = 0.0
    points: tuple[tuple[float, float], ...] = ()
    """Measured (x, ms) pairs; given in any order, kept sorted by x."""
    _xs: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pts = tuple(sorted((b, ms) for b, ms in self.points))
        if any(b <= 0 or ms < 0 for b, ms in pts):
            raise ValueError(f"cost points need batch > 0 and ms >= 0 (got {self.points})")
        if len({b for b, _ in pts}) != len(pts):
            raise ValueError(f"cost points have repeated batch sizes (got {self.points})")
        object.__setattr__(self, "points", pts)
        object.__setattr__(self, "_xs", tuple(b for b, _ in pts))

    def ms(self, x: float) -> float:
        pts = self.points
        if not pts:
            return max(0.0, self.a_ms + self.c_ms * x)
        if len(pts) == 1:
            return pts[0][1] * x / pts[0][0]
        xs = self._xs
        i = bisect.bisect_left(xs, x)
        if i < len(pts) and xs[i] == x:
            return pts[i][1]
        lo, hi = (0, 1) if i == 0 else (len(pts) - 2, len(pts) - 1) if i >= len(pts) else (i - 1, i)
        (x0, y0), (x1, y1) = pts[lo], pts[hi]
        y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return max(y, 0.01 * pts[0][1])


@dataclass(frozen=True)
class CostModel:
    """What a batch costs on the device, in the scenario's cost unit."""

    unit: CostUnit
    base: DeviceCurve
    shifted: DeviceCurve | None = None
    shift_at_ms: float | None = None
    max_batch: int | None = None
    """Device memory limit in requests: larger batches do not fit (applies to every policy)."""

    def curve_at(self, now_ms: float) -> DeviceCurve:
        if self.shifted is not None and self.shift_at_ms is not None and now_ms >= self.shift_at_ms:
            return self.shifted
        return self.base

    def batch_ms(self, size: int, tokens: int, now_ms: float, scale: float = 1.0) -> float:
        x = tokens if self.unit == "tokens" else size
        return scale * self.curve_at(now_ms).ms(x)

    def profile_points(self, cap: int, mean_tokens: float = 1.0, scale: float = 1.0) -> tuple[tuple[int, float], ...]:
        """What `batchtide profile` would measure before the run: t(b) of the base curve at
        half-octave request counts (1, 2, 3, 4, 6, 8, 12, ...) up to `cap` (and at `cap`),
        a token curve at the mean tokens per request."""
        sizes = []
        b = 1
        while b < cap:
            sizes.append(b)
            if b >= 2 and b + b // 2 < cap:
                sizes.append(b + b // 2)
            b *= 2
        sizes.append(cap)
        return tuple((b, scale * self.base.ms(b * mean_tokens if self.unit == "tokens" else b)) for b in sizes)

    def physical_limit_rps(self, cap: int, mean_tokens: float = 1.0, scale: float = 1.0) -> float:
        """max over b <= cap of b / t(b), on the base and (if any) the shifted curve (the lower)."""
        if self.max_batch is not None:
            cap = min(cap, self.max_batch)
        curves = [self.base] + ([self.shifted] if self.shifted is not None else [])
        per_curve = []
        for curve in curves:
            best = 0.0
            for b in range(1, cap + 1):
                x = b * mean_tokens if self.unit == "tokens" else b
                best = max(best, b / (scale * curve.ms(x)) * 1000.0)
            per_curve.append(best)
        return min(per_curve)
