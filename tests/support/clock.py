"""A clock that moves only when a test moves it (the consumer's `consumers.clock.Clock`)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class FakeWake:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """Wall clock and monotonic clock advance together; `advance` fires due wake-ups in time order."""

    def __init__(self, now_ms: float = 1_700_000_000_000.0) -> None:
        self._now_ms = now_ms
        self._start_ms = now_ms
        self._due: list[tuple[float, int, FakeWake, Callable[[], None]]] = []
        self._order = itertools.count()

    def now_ms(self) -> float:
        return self._now_ms

    def monotonic_s(self) -> float:
        return (self._now_ms - self._start_ms) / 1000.0

    def wake_at(self, at_ms: float, callback: Callable[[], None]) -> FakeWake:
        wake = FakeWake()
        heapq.heappush(self._due, (at_ms, next(self._order), wake, callback))
        return wake

    @property
    def pending_wakes(self) -> list[float]:
        return sorted(at for at, _, wake, _ in self._due if not wake.cancelled)

    def advance(self, ms: float) -> None:
        until = self._now_ms + ms
        while self._due and self._due[0][0] <= until:
            at, _, wake, callback = heapq.heappop(self._due)
            if wake.cancelled:
                continue
            self._now_ms = max(self._now_ms, at)
            callback()
        self._now_ms = until
