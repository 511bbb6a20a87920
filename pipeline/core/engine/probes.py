"""Exploration: which batch the cap limits is sent at another size, and which size.

Deterministic: every `probe_every`-th batch that the cap limits is sent at a
probe size, alternately above the cap (re-check that bigger still does not
pay) and below it (find a peak that greedy dispatch at the cap never
visits). Below: 3/4 of the cap while unmeasured, then the nearest unmeasured
size in between, so a knee is bracketed to one size (at hard_cap only 3/4 is
tried). Above: twice the cap (4/3 near hard_cap) while no larger size was
measured slower, so a far knee is found in a few doublings; past a measured
peak, the unmeasured sizes nearest the cap (up to twice it), then a re-check
a third above, because a probe at twice the knee adds most of its compute to
the tail of its batch. Below the cap a measured size is not probed again;
above it the re-check size is measured again and again. While probes leave
the cap where it was, the interval doubles (up to 64); a cap change or a
shift resets it, and while the curve re-learns after a shift every 2nd
cap-limited batch is a probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable

MAX_PROBE_INTERVAL = 64


class Probes:
    """When the next probe is due, and where it goes."""

    def __init__(self, probe_every: int, hard_cap: int) -> None:
        self._probe_every = probe_every
        self._hard_cap = hard_cap
        self._since_probe = 0
        self._interval = probe_every
        self._cap_at_last_probe = hard_cap
        self._up = False

    def restart(self) -> None:
        """After a shift: the old curve's calm says nothing, probe at the base rate again."""
        self._since_probe = 0
        self._interval = self._probe_every

    def size(
        self,
        cap: int,
        shifting: bool,
        peaked: Callable[[int], bool],
        first_unmeasured: Callable[[tuple[int, ...]], int | None],
    ) -> int | None:
        """Size to try instead of `cap` for this cap-limited batch, or None.

        `peaked(cap)`: a larger size was measured and is worse; `first_unmeasured(sizes)`:
        the first of `sizes` the curve has no estimate for (far end first, then from the
        cap outwards)."""
        self._since_probe += 1
        every = 2 if shifting else self._interval
        if self._since_probe < every:
            return None
        self._since_probe = 0
        self._up = not self._up
        hard_cap = self._hard_cap
        if cap == self._cap_at_last_probe:
            self._interval = min(self._interval * 2, MAX_PROBE_INTERVAL)
        else:
            self._interval = self._probe_every
            self._cap_at_last_probe = cap
        double = min(hard_cap, 2 * cap)
        if peaked(cap):
            # Past a measured peak a probe at twice the knee would cost the tail of
            # its batch most: step up through the unmeasured sizes nearest first,
            # and re-check a third above once they are all known.
            far_up = min(hard_cap, max(cap + 1, math.ceil(cap * 4 / 3)))
            up = first_unmeasured(tuple(range(cap + 1, double + 1)))
        else:
            far_up = min(hard_cap, max(cap + 1, double if double == 2 * cap else math.ceil(cap * 4 / 3)))
            up = first_unmeasured((far_up, *range(cap + 1, far_up)))
        far_down = max(1, min(cap - 1, math.floor(cap * 3 / 4)))
        fine_down = range(cap - 1, far_down, -1) if cap < hard_cap else range(0)
        down = first_unmeasured((far_down, *fine_down))
        if self._up and cap < hard_cap:
            return far_up if up is None else up
        if down is not None and cap > 1:
            return down
        if cap < hard_cap:
            return far_up if up is None else up
        return None
