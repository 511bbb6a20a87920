"""A decode loop's step time by rows, learned from its decode steps as they are timed.

A consumer's answers give its time per output token only when they end: an
answer of a hundred tokens that started before a co-tenant took half of the
core reports the slowdown a hundred steps late, and a balance that reads
answers hands nothing on until the slowdown is old (live, a consumer that
slowed down mid-run forwarded none of its requests). The loop times every
plain decode step where it runs (a step that carries a prompt chunk or a
prefill is not plain), and this learns from those.

A step of `rows` rows is read as `pace x shape(rows)`:

- `shape`: per number of rows, the median of its recent steps, each divided
  by the pace when it ran (what a step of those rows costs at pace 1), made
  non-decreasing in rows (`buckets.monotone`);
- `pace`: the median of the last PACE_STEPS steps' ratios to the shape at
  their rows (rows within those measured: past them the shape is a guess,
  and a guess read as a pace would skew every row's shape): a device that slows down by any factor shows within about half
  of PACE_STEPS steps, at every number of rows (those the loop does not run
  now included), and a stray step (a collection, a burst on the host) moves
  nothing.

Pure: no clock; the caller passes each step's measured duration.
"""

from __future__ import annotations

from collections import deque

from pipeline.core.engine.buckets import Bucket, interpolate, monotone

PACE_STEPS = 7
"""Recent steps the pace is the median of: a shift shows after four of them."""
LEARN_STEPS = 16
"""Steps timed before the pace says anything (`StepPace.learned`)."""


class StepPace:
    """The decode step by rows of one loop, from its timed plain steps."""

    def __init__(self) -> None:
        self._buckets: dict[int, Bucket] = {}
        self._shape: list[tuple[int, float]] = []
        self._ratios: deque[float] = deque(maxlen=PACE_STEPS)
        self.pace = 1.0
        """Recent steps over the shape at their rows (1.0: as the shape was learned)."""
        self.steps = 0
        """Steps timed so far."""

    def stepped(self, rows: int, ms: float) -> None:
        """A plain decode step of `rows` rows took `ms`."""
        if rows < 1 or ms <= 0:
            return
        within = bool(self._shape) and self._shape[0][0] <= rows <= self._shape[-1][0]
        expected = interpolate(self._shape, rows) if within else None
        if expected:
            self._ratios.append(ms / expected)
            ordered = sorted(self._ratios)
            self.pace = ordered[len(ordered) // 2]
        bucket = self._buckets.get(rows)
        if bucket is None:
            bucket = self._buckets[rows] = Bucket()
        bucket.add(rows, ms / self.pace)
        self._shape = monotone(sorted((b.size, b.time_ms, len(b.times)) for b in self._buckets.values()))
        self.steps += 1

    @property
    def learned(self) -> bool:
        return self.steps >= LEARN_STEPS

    def step_ms(self, rows: float) -> float | None:
        """A step of `rows` rows now (None before any step)."""
        shape = interpolate(self._shape, max(1.0, rows))
        return None if shape is None else shape * self.pace

    def points(self) -> list[tuple[int, float]]:
        """The step curve now: (rows, ms) at every number of rows measured, non-decreasing."""
        return [(rows, ms * self.pace) for rows, ms in self._shape]
