"""Rolling quantiles of queue waits, and the tail-marking threshold derived from them.

Quantiles are taken over the last `wait_sample_window` dispatched requests: a
sorted list updated with bisect (insert the new wait, delete the one leaving
the window), so any quantile is one index away and each sample costs a short
memmove inside C, not a sort.

Why the threshold comes from the upper tail and not from the p50 (the field
report's 2 x p50): when a free device dispatches at once, most waits are near
zero and any multiple of the p50 is tiny, so everything that waited at all is
marked and marking reorders nothing. The tail starts where the wait
distribution's upper quantile is; a request past `ratio x` that quantile is
unusual for this load, whatever the load is.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque


class WaitTracker:
    """Recent queue waits of dispatched requests and the marking threshold."""

    def __init__(
        self, window: int, min_samples: int, mark_ratio: float, floor_ms: float, quantile: float = 0.5
    ) -> None:
        self._window = window
        self._min_samples = min_samples
        self._ratio = mark_ratio
        self._quantile = quantile
        self._floor_ms = floor_ms
        self._arrival: deque[float] = deque()
        self._sorted: list[float] = []
        self.dispatched = 0
        self.marked = 0
        """Dispatched requests that had been marked (for the marked share)."""

    def record(self, waits_ms: list[float], marked: int) -> None:
        """Add the queue waits of one dispatched batch, `marked` of them tails."""
        arrival = self._arrival
        ordered = self._sorted
        window = self._window
        for wait_ms in waits_ms:
            if len(arrival) == window:
                del ordered[bisect_left(ordered, arrival.popleft())]
            arrival.append(wait_ms)
            insort(ordered, wait_ms)
        self.dispatched += len(waits_ms)
        self.marked += marked

    @property
    def p50_ms(self) -> float | None:
        ordered = self._sorted
        if not ordered:
            return None
        return ordered[len(ordered) // 2]

    def quantile_ms(self, q: float) -> float | None:
        ordered = self._sorted
        if not ordered:
            return None
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def threshold_ms(self) -> float | None:
        """Wait past which a pending request is a tail; None while marking is off
        or fewer than `tail_min_samples` waits were seen (a quantile of three means nothing)."""
        if self._ratio <= 0 or len(self._sorted) < self._min_samples:
            return None
        reference = self.quantile_ms(self._quantile)
        assert reference is not None
        return max(self._ratio * reference, self._floor_ms)

    @property
    def marked_share(self) -> float:
        return self.marked / self.dispatched if self.dispatched else 0.0
