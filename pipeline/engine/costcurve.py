"""Online cost curve t(b) and the effective cap at its batch-friendliness knee.

Each batch-size bucket keeps the median of its last few compute times (robust
to a stray slow batch). No line is fitted: a curve that plateaus, or whose
throughput b/t(b) falls past a peak (an encoder limited by memory
bandwidth), is read as it is.

Knee: a larger batch counts as better only if it raises throughput by more
than `knee_tolerance` per doubling of the size. Taking logs, the knee is the
smallest observed size maximising

    g(b) = log(b / t(b)) - log2(b) * log(1 + knee_tolerance)

one pass over the buckets. The cap is the knee only when there is evidence:
a larger size was observed and was not better. Throughput still rising at
the largest observed size says nothing about bigger ones, so the cap stays
at hard_cap until they are seen. Sizes whose t(b) passes the compute budget
are never candidates.

Exploration is deterministic: every `probe_every`-th batch that the cap
limits is sent at a probe size, alternately a step above the cap (re-check
that bigger still does not pay) and a step below (find a peak that greedy
dispatch at the cap never visits).

Shift: each completion is compared with its bucket's estimate; an EWMA of
log(observed / estimate) past log(1.2) means the model changed (a heavier
build shipped). Stale points are dropped and the curve re-learned; for the
next `shift_batches` completions probes are frequent, the cap may only go
down, and the reason on every dispatch record is `shift`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

SAMPLES_PER_BUCKET = 5
MAX_BUCKETS = 64
DRIFT_ALPHA = 0.3
DRIFT_LIMIT = math.log(1.2)


@dataclass(slots=True)
class _Bucket:
    times: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES_PER_BUCKET))
    sizes: deque[int] = field(default_factory=lambda: deque(maxlen=SAMPLES_PER_BUCKET))

    @property
    def time_ms(self) -> float:
        ordered = sorted(self.times)
        return ordered[len(ordered) // 2]

    @property
    def size(self) -> int:
        return max(self.sizes)


class CostCurve:
    """t(b) per size bucket, the knee-derived cap, probes and shift detection."""

    def __init__(
        self,
        hard_cap: int,
        knee_tolerance: float,
        budget_ms: float | None,
        *,
        probe_every: int = 8,
        shift_batches: int = 24,
        enabled: bool = True,
    ) -> None:
        self._hard_cap = hard_cap
        self._doubling_penalty = math.log(1.0 + knee_tolerance) / math.log(2.0)
        self._budget_ms = budget_ms
        self._width = max(1, math.ceil(hard_cap / MAX_BUCKETS))
        self._buckets: dict[int, _Bucket] = {}
        self._probe_every = probe_every
        self._shift_batches = shift_batches
        self._enabled = enabled
        self._drift = 0.0
        self._shift_left = 0
        self._shift_ceiling = hard_cap
        self._since_probe = 0
        self._probe_up = False
        self._stale = 0
        self._points: list[tuple[int, float]] = []
        self.cap = hard_cap
        """Effective cap, in cost units, never above hard_cap."""
        self.reason = "configured"
        """Where `cap` comes from: configured, knee, budget or shift."""
        self.shifts = 0
        """Shifts of t(b) detected so far."""

    def observe(self, size: int, compute_ms: float) -> None:
        """Learn from one completed batch of `size` cost units."""
        if size <= 0 or compute_ms <= 0:
            return
        key = (size - 1) // self._width
        bucket = self._buckets.get(key)
        refresh = bucket is None
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        elif len(bucket.times) >= 3:
            self._drift = (1 - DRIFT_ALPHA) * self._drift + DRIFT_ALPHA * math.log(
                compute_ms / bucket.time_ms
            )
            if abs(self._drift) > DRIFT_LIMIT:
                self._start_shift()
                bucket = self._buckets[key] = _Bucket()
                refresh = True
        bucket.times.append(compute_ms)
        bucket.sizes.append(size)
        if self._shift_left:
            self._shift_left -= 1
            refresh = refresh or self._shift_left == 0
        self._stale += 1
        if refresh or self._stale >= 4:
            self._recompute()

    def _start_shift(self) -> None:
        self.shifts += 1
        self._shift_ceiling = self.cap
        self._buckets.clear()
        self._drift = 0.0
        self._shift_left = self._shift_batches
        self._since_probe = 0

    def _recompute(self) -> None:
        self._stale = 0
        self._points = sorted((b.size, b.time_ms) for b in self._buckets.values())
        if not self._enabled:
            return
        cap, reason = self._knee_cap()
        if self._shift_left:
            cap, reason = min(cap, self._shift_ceiling), "shift"
        self.cap, self.reason = cap, reason

    def _knee_cap(self) -> tuple[int, str]:
        points = self._points
        if not points:
            return self._hard_cap, "configured"
        budget = self._budget_ms
        budget_cap = self._hard_cap
        candidates = points
        if budget is not None:
            over = [(s, t) for s, t in points if t > budget]
            if over:
                first_over, t_over = over[0]
                candidates = [(s, t) for s, t in points if s < first_over and t <= budget]
                budget_cap = (
                    candidates[-1][0]
                    if candidates
                    else max(1, math.floor(first_over * budget / t_over))
                )
        knee_cap = self._hard_cap
        if candidates:
            penalty = self._doubling_penalty
            best_size, best_g = 0, -math.inf
            for s, t in candidates:
                g = math.log(s / t) - penalty * math.log(s)
                if g > best_g:
                    best_size, best_g = s, g
            if best_size < candidates[-1][0]:
                knee_cap = best_size
        cap = min(self._hard_cap, knee_cap, budget_cap)
        if cap == self._hard_cap:
            return cap, "configured"
        return cap, ("budget" if budget_cap < knee_cap else "knee")

    def probe_cap(self) -> int | None:
        """Size to try instead of the cap for this cap-limited batch, or None.

        Called once per batch the cap limits; every `probe_every`-th one (every
        2nd while re-learning after a shift) is a probe.
        """
        if not self._enabled:
            return None
        self._since_probe += 1
        every = 2 if self._shift_left else self._probe_every
        if self._since_probe < every:
            return None
        self._since_probe = 0
        self._probe_up = not self._probe_up
        cap = self.cap
        up = min(self._hard_cap, max(cap + 1, math.ceil(cap * 4 / 3)))
        down = max(1, min(cap - 1, math.floor(cap * 3 / 4)))
        if self._probe_up and cap < self._hard_cap:
            return up
        if cap > 1:
            return down
        return up if cap < self._hard_cap else None

    def estimate_ms(self, size: int) -> float | None:
        """Expected compute time of a batch of `size` cost units (None: nothing learned)."""
        points = self._points
        if not points:
            return None
        lower = None
        for s, t in points:
            if s == size:
                return t
            if s > size:
                if lower is None:
                    return t
                s0, t0 = lower
                return t0 + (t - t0) * (size - s0) / (s - s0)
            lower = (s, t)
        s_last, t_last = points[-1]
        return t_last * size / s_last

    @property
    def shifting(self) -> bool:
        return self._shift_left > 0

    def points(self) -> list[tuple[int, float]]:
        """Current (size, t) estimates, smallest size first."""
        return list(self._points)
