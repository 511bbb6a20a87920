"""Shift detection: the model behind the curve changed (a heavier build shipped), not noise.

Each completion is compared with its bucket's median; five in a row off by
more than 40%, all the same way, and well outside the bucket's own noise,
means a shift. The cost curve then drops its stale points and re-learns.
"""

from __future__ import annotations

import math

SHIFT_RATIO = math.log(1.4)
"""A completion this far (either way) from its bucket's median is out of line."""
SHIFT_RUN = 5
"""This many out-of-line completions in a row, all the same way, is a shift: a
bucket's median of 9 has not flipped yet, and noise rarely lines up 5 times."""
NOISE_MULTIPLE = 3.0
"""A shift must lie this many median absolute deviations (of log t) off the bucket."""


class ShiftWatch:
    """The current run of out-of-line completions."""

    def __init__(self) -> None:
        self._direction = 0
        self._run = 0

    def shifted(self, compute_ms: float, expected_ms: float, spread: float) -> bool:
        """Count one completion against what was expected of it; True (and a fresh run) on a shift."""
        deviation = math.log(compute_ms / expected_ms)
        # On a busy host the bucket's own spread can exceed 40%: only a
        # departure well outside that noise is a shift, or noise would
        # clear the curve again and again and drag the cap down.
        limit = max(SHIFT_RATIO, NOISE_MULTIPLE * spread)
        direction = (deviation > limit) - (deviation < -limit)
        if direction and direction == self._direction:
            self._run += 1
        else:
            self._direction, self._run = direction, 1 if direction else 0
        if self._run >= SHIFT_RUN:
            self._direction, self._run = 0, 0
            return True
        return False
