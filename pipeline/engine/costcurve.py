"""Online cost curve t(b) and the effective cap at its batch-friendliness knee.

Each batch-size bucket keeps the median of its last 9 compute times (robust
to a stray slow batch), and the bucket medians are made non-decreasing in b
(pooling neighbours that noise put out of order). No line is fitted: a curve
that plateaus, or whose throughput b/t(b) falls past a peak (an encoder
limited by memory bandwidth), is read as it is.

Knee: a larger batch counts as better only if it raises throughput by more
than `knee_tolerance` per doubling of the size. Taking logs, the knee is the
smallest observed size maximising

    g(b) = log(b / (t(b) + o)) - log2(b) * log(1 + knee_tolerance)

where o is the driver's per-batch overhead outside the device
(`batch_overhead_ms`: producing results and events, the thread hop)

one pass over the buckets. Measured times are noisy (token mixes, a shared
GPU), so a size scoring within the noise (the median spread of log t inside
the buckets) of the best is not worse: the cap reaches the largest such size. The cap is the knee only when there is evidence:
a larger size was observed and was not better. Throughput still rising at
the largest observed size says nothing about bigger ones, so the cap stays at
hard_cap until they are seen. Optionally (`start_cap`, profile `cap_ramp`) it
ramps instead: twice the largest size seen, from the target up to hard_cap,
so a model whose throughput collapses at large batches is never hit with a
hard_cap-sized batch before the knee is known, while an affine one reaches
hard_cap within a few doublings. Sizes whose t(b) passes the compute budget
are never candidates.

Exploration is deterministic: every `probe_every`-th batch that the cap
limits is sent at a probe size, alternately above the cap (re-check that
bigger still does not pay) and below it (find a peak that greedy dispatch at
the cap never visits). Below: 3/4 of the cap while unmeasured, then the
nearest unmeasured size in between, so a knee is bracketed to one size (at
hard_cap only 3/4 is tried). Above: twice the cap (4/3 near hard_cap) while
no larger size was measured slower, so a far knee is found in a few
doublings; past a measured peak, the unmeasured sizes nearest the cap (up to
twice it), then a re-check a third above, because a probe at twice the knee
adds most of its compute to the tail of its batch. Below the cap a measured
size is not probed again; above it the re-check size is measured again and
again. While probes leave the cap where it was, the interval doubles (up to
64); a cap change or a shift resets it.

Shift: each completion is compared with its bucket's median; five in a row
off by more than 40%, all the same way, means the model changed (a heavier
build shipped), not noise. Stale points are dropped and the curve re-learned; for the
next `shift_batches` completions probes are frequent, the cap may only go
down, and the reason on every dispatch record is `shift`.
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
SHIFT_RATIO = math.log(1.4)
"""A completion this far (either way) from its bucket's median is out of line."""
SHIFT_RUN = 5
"""This many out-of-line completions in a row, all the same way, is a shift: a
bucket's median of 9 has not flipped yet, and noise rarely lines up 5 times."""
NOISE_MULTIPLE = 3.0
"""A shift must lie this many median absolute deviations (of log t) off the bucket."""
EVIDENCE_SAMPLES = 3
"""Completions a larger size needs before "it was not better" lowers the cap."""
MAX_PROBE_INTERVAL = 64


@dataclass(slots=True)
class _Bucket:
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


def _monotone(points: list[tuple[int, float, int]]) -> list[tuple[int, float]]:
    """Make t(b) non-decreasing in b (pool adjacent violators, weighted by samples).

    A bigger batch never computes faster; when noise says otherwise (a bucket
    of short requests), neighbours are pooled instead of read as a cliff.
    """
    blocks: list[list[float]] = []  # [time x weight, weight, first index, last index]
    for index, (_, time_ms, weight) in enumerate(points):
        blocks.append([time_ms * weight, float(weight), index, index])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            last = blocks.pop()
            blocks[-1][0] += last[0]
            blocks[-1][1] += last[1]
            blocks[-1][3] = last[3]
    smoothed: list[tuple[int, float]] = []
    for total, weight, first, last in blocks:
        for index in range(int(first), int(last) + 1):
            smoothed.append((points[index][0], total / weight))
    return smoothed


class CostCurve:
    """t(b) per size bucket, the knee-derived cap, probes and shift detection."""

    def __init__(
        self,
        hard_cap: int,
        knee_tolerance: float,
        budget_ms: float | None,
        *,
        overhead_ms: float = 0.0,
        start_cap: int | None = None,
        probe_every: int = 8,
        shift_batches: int = 24,
        enabled: bool = True,
    ) -> None:
        self._hard_cap = hard_cap
        self._start_cap = hard_cap if start_cap is None or not enabled else min(start_cap, hard_cap)
        self._doubling_penalty = math.log(1.0 + knee_tolerance) / math.log(2.0)
        self._budget_ms = budget_ms
        self._overhead_ms = overhead_ms
        self._buckets: dict[int, _Bucket] = {}
        self._probe_every = probe_every
        self._shift_batches = shift_batches
        self._enabled = enabled
        self._run_direction = 0
        self._run = 0
        self._shift_left = 0
        self._shift_ceiling = hard_cap
        self._since_probe = 0
        self._probe_interval = probe_every
        self._cap_at_last_probe = hard_cap
        self._probe_up = False
        self._stale = 0
        self._points: list[tuple[int, float]] = []
        self._evidence = 0
        """Largest size measured at least EVIDENCE_SAMPLES times."""
        self._noise = 0.0
        """Typical spread of log t within a bucket: sizes scoring within it of the
        best are not worse, and the cap reaches the largest of them."""
        self.cap = self._start_cap
        """Throughput cap, in cost units, never above hard_cap: the knee inside the
        memory limit, what a backlog is served at."""
        self.reason = "ramp" if self._start_cap < hard_cap else "configured"
        """Where `cap` comes from: configured, ramp, knee or shift."""
        self.latency_cap = self.cap
        """`cap` cut to the compute budget: what batches are shaped to while the queue is short."""
        self.latency_reason = self.reason
        """`budget` when the budget cut it, else `reason`."""
        self.shifts = 0
        """Shifts of t(b) detected so far."""

    def prefill(self, points: list[tuple[int, float]]) -> None:
        """Start from a measured curve (a profile file) instead of probing it cold:
        each point counts as EVIDENCE_SAMPLES completions, so live ones take over
        within a few batches if the device has changed since."""
        for size, time_ms in points:
            for _ in range(EVIDENCE_SAMPLES):
                self.observe(size, time_ms)
        self._recompute()

    def observe(self, size: int, compute_ms: float) -> None:
        """Learn from one completed batch of `size` cost units."""
        if size <= 0 or compute_ms <= 0:
            return
        key = bucket_key(size)
        bucket = self._buckets.get(key)
        refresh = bucket is None
        if bucket is not None and len(bucket.times) >= 3:
            expected, spread = bucket.time_ms, bucket.spread or 0.0
        else:
            # A size with too few samples of its own is compared with the curve
            # between its neighbours, so a shift shows at sizes the old curve
            # never measured (a prefilled profile, a cap that moved).
            expected, spread = self.estimate_ms(size), self._noise
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        if expected is not None:
            deviation = math.log(compute_ms / expected)
            # On a busy host the bucket's own spread can exceed 40%: only a
            # departure well outside that noise is a shift, or noise would
            # clear the curve again and again and drag the cap down.
            limit = max(SHIFT_RATIO, NOISE_MULTIPLE * spread)
            direction = (deviation > limit) - (deviation < -limit)
            if direction and direction == self._run_direction:
                self._run += 1
            else:
                self._run_direction, self._run = direction, 1 if direction else 0
            if self._run >= SHIFT_RUN:
                self._start_shift()
                bucket = self._buckets[key] = _Bucket()
                refresh = True
        bucket.add(size, compute_ms)
        refresh = refresh or len(bucket.times) == EVIDENCE_SAMPLES
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
        self._run_direction, self._run = 0, 0
        self._shift_left = self._shift_batches
        self._since_probe = 0
        self._probe_interval = self._probe_every

    def _recompute(self) -> None:
        self._stale = 0
        self._points = _monotone(
            sorted((b.size, b.time_ms, len(b.times)) for b in self._buckets.values())
        )
        spreads = sorted(b.spread for b in self._buckets.values() if b.spread is not None)
        self._noise = spreads[len(spreads) // 2] if spreads else 0.0
        self._evidence = max(
            (b.size for b in self._buckets.values() if len(b.times) >= EVIDENCE_SAMPLES), default=0
        )
        if not self._enabled:
            return
        cap, reason = self._knee_cap()
        if self._shift_left:
            cap, reason = min(cap, self._shift_ceiling), "shift"
            if self.latency_cap > cap:
                self.latency_cap, self.latency_reason = cap, reason
        self.cap, self.reason = cap, reason

    def _knee_cap(self) -> tuple[int, str]:
        points = self._points
        if not points:
            self.latency_cap, self.latency_reason = self._start_cap, self._start_reason()
            return self._start_cap, self._start_reason()
        budget_cap = self._budget_cap(points)
        best_size, best_g = 0, -math.inf
        for s, t in points:
            g = self._score(s, t)
            if g > best_g:
                best_size, best_g = s, g
        reach = max(s for s, t in points if self._score(s, t) >= best_g - self._noise)
        largest = points[-1][0]
        knee_reason = "knee"
        if reach < min(largest, self._evidence):
            knee_cap = reach
        elif reach < largest:
            knee_cap = largest  # not better once: measure it again before moving
        else:
            knee_cap, knee_reason = max(self._start_cap, 2 * largest), "ramp"
        cap = min(self._hard_cap, knee_cap)
        reason = "configured" if cap == self._hard_cap else knee_reason
        if budget_cap < cap:
            self.latency_cap, self.latency_reason = budget_cap, "budget"
        else:
            self.latency_cap, self.latency_reason = cap, reason
        return cap, reason

    def _start_reason(self) -> str:
        return "ramp" if self._start_cap < self._hard_cap else "configured"

    def _budget_cap(self, points: list[tuple[int, float]]) -> int:
        """Largest size whose t(b) stays within the compute budget (hard_cap if all do)."""
        budget = self._budget_ms
        if budget is None:
            return self._hard_cap
        over = [(s, t) for s, t in points if t > budget]
        if not over:
            return self._hard_cap
        first_over, t_over = over[0]
        under = [(s, t) for s, t in points if s < first_over]
        # The size where t(b) crosses the budget, interpolated between the last
        # measured size under it and the first over it (from 0 ms at size 0 when
        # none is under): unmeasured sizes in between count.
        s_under, t_under = under[-1] if under else (0, 0.0)
        return max(1, s_under + math.floor((first_over - s_under) * (budget - t_under) / (t_over - t_under)))

    def _score(self, size: int, time_ms: float) -> float:
        """log throughput, less the tolerance per doubling: the knee maximises it.

        Throughput counts the driver's per-batch overhead too: a model that
        computes in microseconds is limited by that overhead, not by t(b).
        """
        return math.log(size / (time_ms + self._overhead_ms)) - self._doubling_penalty * math.log(size)

    def probe_cap(self) -> int | None:
        """Size to try instead of the cap for this cap-limited batch, or None.

        Called once per batch the cap limits; every `probe_every`-th one (every
        2nd while re-learning after a shift) is a probe.
        """
        if not self._enabled:
            return None
        self._since_probe += 1
        every = 2 if self._shift_left else self._probe_interval
        if self._since_probe < every:
            return None
        self._since_probe = 0
        self._probe_up = not self._probe_up
        cap = self.cap
        if cap == self._cap_at_last_probe:
            self._probe_interval = min(self._probe_interval * 2, MAX_PROBE_INTERVAL)
        else:
            self._probe_interval = self._probe_every
            self._cap_at_last_probe = cap
        double = min(self._hard_cap, 2 * cap)
        if self._peaked(cap):
            # Past a measured peak a probe at twice the knee would cost the tail of
            # its batch most: step up through the unmeasured sizes nearest first,
            # and re-check a third above once they are all known.
            far_up = min(self._hard_cap, max(cap + 1, math.ceil(cap * 4 / 3)))
            up = self._first_unmeasured(tuple(range(cap + 1, double + 1)))
        else:
            far_up = min(self._hard_cap, max(cap + 1, double if double == 2 * cap else math.ceil(cap * 4 / 3)))
            up = self._first_unmeasured((far_up, *range(cap + 1, far_up)))
        far_down = max(1, min(cap - 1, math.floor(cap * 3 / 4)))
        fine_down = range(cap - 1, far_down, -1) if cap < self._hard_cap else range(0)
        down = self._first_unmeasured((far_down, *fine_down))
        if self._probe_up and cap < self._hard_cap:
            return far_up if up is None else up
        if down is not None and cap > 1:
            return down
        if cap < self._hard_cap:
            return far_up if up is None else up
        return None

    def _peaked(self, cap: int) -> bool:
        """The largest size measured above `cap` has a lower throughput than `cap`."""
        largest, t_largest = self._points[-1] if self._points else (0, 0.0)
        t_cap = self.estimate_ms(cap)
        if largest <= cap or t_cap is None:
            return False
        overhead = self._overhead_ms
        return largest / (t_largest + overhead) < cap / (t_cap + overhead)

    def _first_unmeasured(self, sizes: tuple[int, ...]) -> int | None:
        """First size in `sizes` whose bucket has no estimate, else None.

        Sizes come far end first (big steps while the curve is unknown), then
        from the cap outwards (fine steps that bracket the knee once the far
        end is known). Below the cap, measured sizes are not probed again:
        an affine model at saturation then pays for no probes at all, and a
        shift clears the buckets so they are probed anew. Above the cap the
        far end is re-measured (a lighter model may make bigger batches pay).
        """
        for size in sizes:
            if bucket_key(size) not in self._buckets:
                return size
        return None

    def estimate_ms(self, size: float) -> float | None:
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
