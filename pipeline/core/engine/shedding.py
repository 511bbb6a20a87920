"""Shedding: answer at once what the queue and the learned t(b) say cannot be served in time.

In overload, a request that waits its full turn only to expire at its deadline
costs the client the whole deadline and answers nothing useful; one that runs
and finishes past its SLO takes device time from requests that could still
have made it. So a request that carries a deadline gets a latest useful finish
(`ShedRule.limit`): its deadline, or with `shed_when = "slo"` the earlier of
its deadline and record time + slo_p99_ms. The engine compares that with when
it would finish (`finish_estimate_ms`: the cost queued ahead of it served in
batches of the throughput cap, at the learned t(b), from when a slot frees)
when it arrives, when it reaches the head of the queue and when its batch
leaves (`split_late`), and answers it `expired` with the reason as soon as
the estimate passes the limit. A request
without a deadline is never shed. Pure: every time is an argument.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.core.config import ShedWhen
from pipeline.core.engine.decisions import PendingRequest

DEADLINE_PASSED = "deadline"
"""Reason of an expiry: its deadline passed while it waited."""
CANNOT_MEET_DEADLINE = "cannot_meet_deadline"
"""Reason of a shed: the queue ahead and t(b) put its finish past its deadline."""
CANNOT_MEET_SLO = "cannot_meet_slo"
"""Reason of a shed (`shed_when = "slo"`): its finish would pass record time + slo_p99_ms."""


@dataclass(frozen=True)
class ShedRule:
    """Which finish is too late for a request, and the reason it is answered with."""

    when: ShedWhen
    slo_ms: float

    def limit(self, enqueue_ms: float, deadline_ms: float | None) -> tuple[float, str] | None:
        """Latest useful finish and the reason to give if it cannot be met; None: never shed."""
        if deadline_ms is None or self.when == "never":
            return None
        if self.when == "slo":
            slo_by = enqueue_ms + self.slo_ms
            if slo_by < deadline_ms:
                return slo_by, CANNOT_MEET_SLO
        return deadline_ms, CANNOT_MEET_DEADLINE


def finish_estimate_ms(
    now_ms: float,
    slot_free_ms: float,
    cost_ahead: float,
    cap: int,
    slots: int,
    batch_ms: Callable[[float], float | None],
    overhead_ms: float,
    arrival_cost_per_ms: float = 0.0,
    margin: float = 1.0,
) -> float | None:
    """When the last of `cost_ahead` (cost units, the request's own included) completes if
    batches of `cap` start at `slot_free_ms` on `slots` device streams; None while t(b) is unknown.

    Its own batch is the last, partly filled by what is ahead of it; what arrives from now until
    that batch starts (`arrival_cost_per_ms`) joins it behind the request and lengthens it, up
    to the cap. `margin` stretches that last batch (see `Overruns`)."""
    full = batch_ms(cap)
    if full is None:
        return None
    cost_ahead = max(1.0, cost_ahead)
    batches = math.ceil(cost_ahead / cap)
    rounds = math.ceil(batches / max(1, slots))
    last_start = slot_free_ms + (rounds - 1) * (full + overhead_ms)
    last_cost = cost_ahead - (batches - 1) * cap + arrival_cost_per_ms * max(0.0, last_start - now_ms)
    last = batch_ms(min(cap, last_cost))
    if last is None:
        last = full
    return last_start + last * margin + overhead_ms


def split_late(requests: list[PendingRequest], done_ms: float) -> tuple[list[PendingRequest], list[PendingRequest]]:
    """A leaving batch's members that it finishes in time, and those it would finish too late for
    (a later level's or an older request's limit can be earlier than the head's); all are kept
    when none would be left, since the head passed the same test with a batch at least as long."""
    late = [r for r in requests if r.finish_by_ms is not None and done_ms > r.finish_by_ms]
    if not late or len(late) == len(requests):
        return requests, []
    return [r for r in requests if r.finish_by_ms is None or done_ms <= r.finish_by_ms], late


class Overruns:
    """How much longer batches ran than t(b) said when they left: the stretch the last batch of
    an estimate gets. Costs that vary inside one size (long-tailed prompts counted as requests)
    make the mean t(b) too short for a third of the batches; a request admitted on the mean
    alone would finish late, having used the device for nothing. A device whose time per size is
    steady keeps the stretch at 1."""

    def __init__(self, quantile: float = 0.9, window: int = 64, min_samples: int = 8) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self._quantile = quantile
        self._min_samples = min_samples
        self.margin = 1.0

    def observe(self, compute_ms: float, expected_ms: float) -> None:
        if not expected_ms > 0 or math.isinf(expected_ms):
            return
        self._ratios.append(compute_ms / expected_ms)
        if len(self._ratios) >= self._min_samples:
            ordered = sorted(self._ratios)
            self.margin = max(1.0, ordered[min(len(ordered) - 1, int(self._quantile * len(ordered)))])
