"""Arrival-rate estimate and the one question of the window: does waiting pay?

Why the window is usually zero (the derivation is in docs/engine.md): on a
device with a single slot, holding a batch for w ms idles the device for w,
and every request arriving during the following batch starts w later too. To
first order that push cancels what the requests joining during w gain, so
waiting never pays there; greedy dispatch already fills batches by itself
because the queue grows while the device is busy.

Waiting pays only when the slot we would fill now is the last free one and
other slots are busy: a request arriving in the next few ms would otherwise
wait for the earliest busy slot to free (R ms away) or for this batch
(t(b) ms), whichever first, call it T. Holding the last slot for w gains
λw joiners about (T - w) each and costs the b pending requests w each; the
net λw(T - w) - bw is positive iff λT > b and is largest at
w* = (T - b/λ) / 2. If this batch would free first (t(b) < R), holding also
delays that moment for everyone arriving before it; that push is charged too
and usually cancels the gain, as on a single slot. The pieces come from the
learned cost curve (t(b), and the expected completion of in-flight batches),
not from constants.
"""

from __future__ import annotations

import math
from collections.abc import Callable

FIRST_FILL = -math.expm1(-math.log(2.0) / 8)
"""Most the cold-start correction may scale by (~8x): one arrival reads as
"one per halflife/8", not as an infinite rate."""


class ArrivalRate:
    """Time-decayed arrival counter: O(1) per arrival, half-life `halflife_ms`.

    With decay k = ln2 / halflife, a steady stream of λ per ms holds a decayed
    count of λ/k, so λ ≈ k x count (after the first half-lives; see `_decay_to`). Counts requests and cost units separately
    (they differ when the cost unit is tokens).
    """

    __slots__ = ("_cost", "_first_ms", "_k", "_last_ms", "_requests")

    def __init__(self, halflife_ms: float) -> None:
        self._k = math.log(2.0) / halflife_ms
        self._requests = 0.0
        self._cost = 0.0
        self._last_ms: float | None = None
        self._first_ms = 0.0

    def observe(self, now_ms: float, cost: int) -> None:
        last = self._last_ms
        if last is None:
            self._last_ms = self._first_ms = now_ms
        elif now_ms > last:
            decay = math.exp(-self._k * (now_ms - last))
            self._requests *= decay
            self._cost *= decay
            self._last_ms = now_ms
        self._requests += 1.0
        self._cost += cost

    def _decay_to(self, now_ms: float) -> float:
        """Decay factor from the last arrival to now, divided by the share of
        the decay horizon observed so far (early on the counter has not filled;
        without this the first half-life would read as a near-zero rate)."""
        last = self._last_ms
        if last is None:
            return 0.0
        k = self._k
        decay = math.exp(-k * (now_ms - last)) if now_ms > last else 1.0
        filled = -math.expm1(-k * (now_ms - self._first_ms))
        return decay / max(filled, FIRST_FILL)

    def requests_per_ms(self, now_ms: float) -> float:
        return self._requests * self._decay_to(now_ms) * self._k

    def cost_per_ms(self, now_ms: float) -> float:
        return self._cost * self._decay_to(now_ms) * self._k


def paying_wait_ms(
    *,
    now_ms: float,
    pending_cost: int,
    depth_cost: int,
    goal_cost: int,
    cost_rate_per_ms: float,
    request_rate_per_ms: float,
    free_slots: int,
    next_slot_free_ms: float | None,
    batch_time_ms: Callable[[float], float | None],
) -> float:
    """Extra ms worth waiting from `now_ms` before dispatching; 0 when waiting does not pay.

    `depth_cost` is pending plus the caller's backlog: a known backlog shortens
    the time to fill `goal_cost`. `next_slot_free_ms` is the expected completion
    of the earliest in-flight batch (None when nothing is in flight), and
    `batch_time_ms` the cost curve's t(b). A wait expected to bring less than
    one request is not worth it.
    """
    if free_slots != 1 or next_slot_free_ms is None or cost_rate_per_ms <= 0.0:
        return 0.0
    now_time = batch_time_ms(pending_cost)
    if now_time is None:
        return 0.0
    other_free = next_slot_free_ms - now_ms
    blocked = min(other_free, now_time)
    best = (blocked - pending_cost / cost_rate_per_ms) / 2.0
    fill = max(goal_cost - depth_cost, 0) / cost_rate_per_ms
    wait = min(best, fill)
    if wait <= 0.0 or request_rate_per_ms * wait < 1.0:
        return 0.0
    grown_time = batch_time_ms(pending_cost + cost_rate_per_ms * wait)
    if grown_time is None:
        return 0.0
    pushed = max(min(other_free, wait + grown_time) - blocked, 0.0)
    gain = cost_rate_per_ms * wait * (blocked - wait)
    loss = pending_cost * wait + cost_rate_per_ms * (blocked - wait) * pushed
    return wait if gain > loss else 0.0
