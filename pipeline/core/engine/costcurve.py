"""Online cost curve t(b) and the effective cap at its batch-friendliness knee.

The curve ties four ideas, each in its own module: what was measured
(`buckets.py`: recent times per size, made non-decreasing), where a bigger
batch stops paying and where it passes the compute budget (`knee.py`), which
batches explore other sizes (`probes.py`), and when the model behind the
curve changed (`shift.py`).

Ramp: without a measured knee the cap is hard_cap, or, with `start_cap`
(profile `cap_ramp`, and always under an auto hard_cap), twice the largest
size seen, from the target up to hard_cap, so a model whose throughput
collapses at large batches is never hit with a hard_cap-sized batch before
the knee is known, while an affine one reaches hard_cap within a few
doublings. After a shift drops a prefilled curve the ramp starts again from
the sizes measured since, never at the memory limit in one go.

Shift: when one is detected, stale points are dropped and the curve
re-learned; for the next `shift_batches` completions probes are frequent,
the cap may only go down, and the reason on every dispatch record is `shift`.
"""

from __future__ import annotations

from pipeline.core.engine.buckets import Bucket, bucket_key, interpolate, monotone
from pipeline.core.engine.knee import KneeScore, budget_cap, knee_cap
from pipeline.core.engine.probes import Probes
from pipeline.core.engine.shift import ShiftWatch

EVIDENCE_SAMPLES = 3
"""Completions a larger size needs before "it was not better" lowers the cap."""


class CostCurve:
    """The engine's learned t(b): the knee-derived cap, its latency cut, probes and shifts."""

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
        self._score = KneeScore(knee_tolerance, overhead_ms)
        self._budget_ms = budget_ms
        self._overhead_ms = overhead_ms
        self._buckets: dict[int, Bucket] = {}
        self._probes = Probes(probe_every, hard_cap)
        self._watch = ShiftWatch()
        self._shift_batches = shift_batches
        self._enabled = enabled
        self._shift_left = 0
        self._shift_ceiling = hard_cap
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
        self.reason = self._start_reason()
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
        expected: float | None
        if bucket is not None and len(bucket.times) >= 3:
            expected, spread = bucket.time_ms, bucket.spread or 0.0
        else:
            # A size with too few samples of its own is compared with the curve
            # between its neighbours, so a shift shows at sizes the old curve
            # never measured (a prefilled profile, a cap that moved).
            expected, spread = self.estimate_ms(size), self._noise
        if bucket is None:
            bucket = self._buckets[key] = Bucket()
        if expected is not None and self._watch.shifted(compute_ms, expected, spread):
            self._start_shift()
            bucket = self._buckets[key] = Bucket()
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
        self._shift_left = self._shift_batches
        self._probes.restart()

    def _recompute(self) -> None:
        self._stale = 0
        self._points = monotone(sorted((b.size, b.time_ms, len(b.times)) for b in self._buckets.values()))
        spreads = sorted(b.spread for b in self._buckets.values() if b.spread is not None)
        self._noise = spreads[len(spreads) // 2] if spreads else 0.0
        self._evidence = max((b.size for b in self._buckets.values() if len(b.times) >= EVIDENCE_SAMPLES), default=0)
        if not self._enabled:
            return
        cap, reason = self._knee_cap()
        if self._shift_left:
            cap, reason = min(cap, self._shift_ceiling), "shift"
            if self.latency_cap > cap:
                self.latency_cap, self.latency_reason = cap, reason
        self.cap, self.reason = cap, reason

    def _knee_cap(self) -> tuple[int, str]:
        """The cap and its reason from the points, and (as a side effect) the latency cap."""
        points = self._points
        if not points:
            self.latency_cap, self.latency_reason = self._start_cap, self._start_reason()
            return self._start_cap, self._start_reason()
        under_budget = budget_cap(points, self._budget_ms, self._hard_cap)
        knee, knee_reason = knee_cap(points, self._score, self._noise, self._evidence, self._start_cap)
        cap = min(self._hard_cap, knee)
        reason = "configured" if cap == self._hard_cap else knee_reason
        if under_budget < cap:
            self.latency_cap, self.latency_reason = under_budget, "budget"
        else:
            self.latency_cap, self.latency_reason = cap, reason
        return cap, reason

    def _start_reason(self) -> str:
        return "ramp" if self._start_cap < self._hard_cap else "configured"

    def probe_cap(self) -> int | None:
        """Size to try instead of the cap for this cap-limited batch, or None (probes.py).

        Called once per batch the cap limits; every `probe_every`-th one (every
        2nd while re-learning after a shift) is a probe.
        """
        if not self._enabled:
            return None
        return self._probes.size(self.cap, self._shift_left > 0, self._peaked, self._first_unmeasured)

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

        Below the cap, measured sizes are not probed again: an affine model at
        saturation then pays for no probes at all, and a shift clears the
        buckets so they are probed anew. Above the cap the far end is
        re-measured (a lighter model may make bigger batches pay).
        """
        for size in sizes:
            if bucket_key(size) not in self._buckets:
                return size
        return None

    def estimate_ms(self, size: float) -> float | None:
        """Expected compute time of a batch of `size` cost units (None: nothing learned)."""
        return interpolate(self._points, size)

    @property
    def shifting(self) -> bool:
        return self._shift_left > 0

    def points(self) -> list[tuple[int, float]]:
        """Current (size, t) estimates, smallest size first."""
        return list(self._points)
