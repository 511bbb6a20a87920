"""The loop's background work: batches on the device and the publishes of their answers.

Both run as asyncio tasks so that fetching and deciding go on meanwhile.
They are tracked so that a rebalance or a stop can wait for them
(`settle`), a stop past its budget can abandon them (their offsets stay
uncommitted, so the group reads those records again), and an error in any
of them stops the consumer (`on_error`) instead of vanishing in a task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from consumers.clock import Clock


class Work:
    def __init__(self, clock: Clock, on_error: Callable[[BaseException], None]) -> None:
        self._clock = clock
        self._on_error = on_error
        self.batches: set[asyncio.Task[None]] = set()
        self.publishes: set[asyncio.Task[None]] = set()

    @property
    def busy(self) -> bool:
        return bool(self.batches or self.publishes)

    def run_batch(self, coro: Coroutine[Any, Any, None]) -> None:
        self._track(self.batches, coro)

    def publish(self, coro: Coroutine[Any, Any, None]) -> None:
        self._track(self.publishes, coro)

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Wait for running batches and pending publishes to finish (at most `timeout_s`)."""
        clock = self._clock
        deadline = clock.monotonic_s() + timeout_s
        while self.busy and clock.monotonic_s() < deadline:
            await asyncio.wait(self.batches | self.publishes, timeout=max(0.0, deadline - clock.monotonic_s()))

    async def abandon(self) -> int:
        """Cancel what is unfinished; returns how many tasks that was."""
        abandoned = self.batches | self.publishes
        for task in abandoned:
            task.cancel()
        await asyncio.gather(*abandoned, return_exceptions=True)
        return len(abandoned)

    def _track(self, tasks: set[asyncio.Task[None]], coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        task.add_done_callback(self._check)

    def _check(self, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self._on_error(error)
