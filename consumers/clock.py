"""The consumer's one source of time: a `Clock` passed in, the system's in production.

Two kinds of time, never mixed: wall-clock epoch ms (`now_ms`), because the
engine compares it with Kafka CreateTime and peers compare beacons with it;
monotonic seconds (`monotonic_s`) for budgets that must not jump when NTP
steps the wall clock (the stop budget, warm-up). Wake-ups the engine asks
for are scheduled through the clock too (`wake_at`), so a test's fake clock
(`tests/support/clock.py`) decides when they fire and the loop's decisions
run without a broker or a real wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol


class Wake(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now_ms(self) -> float:
        """Wall-clock epoch ms (comparable with Kafka CreateTime)."""
        ...

    def monotonic_s(self) -> float:
        """Seconds that only go forward: for budgets."""
        ...

    def wake_at(self, at_ms: float, callback: Callable[[], None]) -> Wake:
        """Call `callback` once `now_ms()` reaches `at_ms` (at once if it has)."""
        ...


class SystemClock:
    """The real clocks, and the running event loop's timer for wake-ups."""

    def now_ms(self) -> float:
        return time.time() * 1000.0

    def monotonic_s(self) -> float:
        return time.monotonic()

    def wake_at(self, at_ms: float, callback: Callable[[], None]) -> Wake:
        delay_s = max(0.0, (at_ms - self.now_ms()) / 1000.0)
        return asyncio.get_running_loop().call_later(delay_s, callback)


class Alarm:
    """At most one pending wake-up, re-armed only when the time asked for changes (the loop
    asks after every decision, mostly for the same time)."""

    def __init__(self, clock: Clock, callback: Callable[[], None]) -> None:
        self._clock = clock
        self._callback = callback
        self._wake: Wake | None = None
        self.at_ms: float | None = None

    def set(self, at_ms: float | None) -> None:
        if at_ms == self.at_ms:
            return
        self.cancel()
        self.at_ms = at_ms
        if at_ms is not None:
            self._wake = self._clock.wake_at(at_ms, self._ring)

    def cancel(self) -> None:
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        self.at_ms = None

    def _ring(self) -> None:
        self._wake = None
        self.at_ms = None
        self._callback()
