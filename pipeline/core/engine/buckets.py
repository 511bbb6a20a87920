"""What the cost curve has measured: recent compute times per size bucket, read as a curve.

Each batch-size bucket keeps the median of its last 9 compute times (robust
to a stray slow batch), and the bucket medians are made non-decreasing in b
(pooling neighbours that noise put out of order). No line is fitted: a curve
that plateaus, or whose throughput b/t(b) falls past a peak (an encoder
limited by memory bandwidth), is read as it is.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

SAMPLES_PER_BUCKET = 9
EXACT_SIZES = 64
"""Sizes up to this get a bucket each: at small sizes one request more is a large
relative change in t(b), and pooling 1 with 2 would read as noise or a shift."""
BUCKET_GROWTH = math.log1p(1 / EXACT_SIZES)
"""Past EXACT_SIZES, buckets grow geometrically (~1.6% wide), so a token cap of
thousands still has a few hundred buckets at most."""


def bucket_key(size: int) -> int:
    if size <= EXACT_SIZES:
        return size
    return EXACT_SIZES + int(math.log(size / EXACT_SIZES) / BUCKET_GROWTH)


@dataclass(slots=True)
class Bucket:
    times: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES_PER_BUCKET))
    sizes: deque[int] = field(default_factory=lambda: deque(maxlen=SAMPLES_PER_BUCKET))
    time_ms: float = 0.0
    """Median of `times`."""
    spread: float | None = None
    """Median absolute deviation of log(times) (None under 3 samples): the noise."""

    def add(self, size: int, time_ms: float) -> None:
        self.times.append(time_ms)
        self.sizes.append(size)
        ordered = sorted(self.times)
        median = self.time_ms = ordered[len(ordered) // 2]
        if len(ordered) >= 3:
            deviations = sorted(abs(math.log(t / median)) for t in ordered)
            self.spread = deviations[len(deviations) // 2]

    @property
    def size(self) -> int:
        return max(self.sizes)


def monotone(points: list[tuple[int, float, int]]) -> list[tuple[int, float]]:
    """Make t(b) non-decreasing in b (pool adjacent violators, weighted by samples).

    A bigger batch never computes faster; when noise says otherwise (a bucket
    of short requests), neighbours are pooled instead of read as a cliff.
    """
    blocks: list[list[float]] = []  # [time x weight, weight, first index, last index]
    for index, (_, time_ms, weight) in enumerate(points):
        blocks.append([time_ms * weight, float(weight), float(index), float(index)])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            last = blocks.pop()
            blocks[-1][0] += last[0]
            blocks[-1][1] += last[1]
            blocks[-1][3] = last[3]
    smoothed: list[tuple[int, float]] = []
    for total, pooled, first, last_index in blocks:
        for index in range(int(first), int(last_index) + 1):
            smoothed.append((points[index][0], total / pooled))
    return smoothed


def interpolate(points: list[tuple[int, float]], size: float) -> float | None:
    """t(size) read off the curve: linear between points, proportional to size past the
    largest, the smallest point's time below it; None when nothing is measured."""
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
