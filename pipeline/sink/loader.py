"""Bounded insert buffer: batch by size or age, retry with backoff, ack only after the insert.

The sink hands every decoded event to a `Loader` together with its ack. The
loader inserts in batches (`batch_size` events, or when the oldest buffered
event is `interval_s` old, whichever first) on one worker thread, because
clickhouse-connect calls block. Only when ClickHouse has confirmed the
insert are that batch's events acked, so the Kafka offset that faust commits
never passes an event that is not stored.

When ClickHouse is down or slow the insert is retried with exponential
backoff (capped), and consuming continues into the buffer until it holds
`max_buffer` events; then `put` blocks, the agent stops pulling, and faust
pauses the partitions. Nothing is dropped: an event is either stored and
acked, or still in the buffer (and uncommitted in Kafka) when the sink stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
Ack = Callable[[], Awaitable[object]]
log = logging.getLogger("batchtide.sink")


@dataclass
class LoaderStats:
    received: int = 0
    inserted: int = 0
    duplicates: int = 0
    failures: int = 0
    last_error: str | None = None
    failing_since: float | None = None
    """time.monotonic() of the first failed insert of the current outage (None: healthy)."""


class Loader(Generic[T]):
    """One table's buffer; `insert(batch) -> rows actually inserted` runs on `executor`."""

    def __init__(
        self,
        name: str,
        insert: Callable[[list[T]], int],
        *,
        executor: Executor,
        batch_size: int,
        interval_s: float,
        max_buffer: int,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 30.0,
    ) -> None:
        if batch_size < 1 or max_buffer < batch_size or interval_s <= 0:
            raise ValueError("need batch_size >= 1, max_buffer >= batch_size and interval_s > 0")
        self.name = name
        self._insert = insert
        self._executor = executor
        self.batch_size = batch_size
        self.interval_s = interval_s
        self.max_buffer = max_buffer
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._buffer: deque[tuple[float, T, Ack]] = deque()
        self._arrived = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self.stats = LoaderStats()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    async def put(self, value: T, ack: Ack) -> None:
        """Buffer one event; blocks while the buffer is full (backpressure)."""
        while len(self._buffer) >= self.max_buffer:
            self._space.clear()
            await self._space.wait()
        self._buffer.append((time.monotonic(), value, ack))
        self.stats.received += 1
        if len(self._buffer) >= self.batch_size or len(self._buffer) == 1:
            self._arrived.set()

    async def _due(self) -> None:
        """Return when a batch is full or the oldest buffered event is interval_s old."""
        while True:
            if len(self._buffer) >= self.batch_size:
                return
            if self._buffer:
                wait = self._buffer[0][0] + self.interval_s - time.monotonic()
                if wait <= 0:
                    return
            else:
                wait = None
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=wait)
            except TimeoutError:
                pass

    async def _insert_with_retry(self, batch: list[T]) -> int:
        delay = self.backoff_initial_s
        loop = asyncio.get_running_loop()
        while True:
            try:
                rows = await loop.run_in_executor(self._executor, self._insert, batch)
            except Exception as e:
                self.stats.failures += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"[:500]
                if self.stats.failing_since is None:
                    self.stats.failing_since = time.monotonic()
                log.warning(
                    "%s: insert of %d events failed (%s); retrying in %.1f s, %d buffered",
                    self.name, len(batch), self.stats.last_error, delay, len(self._buffer),
                )  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max_s)
                continue
            if self.stats.failing_since is not None:
                log.warning(
                    "%s: ClickHouse is back after %.1f s", self.name, time.monotonic() - self.stats.failing_since
                )
                self.stats.failing_since = None
            return rows

    async def flush_once(self) -> int:
        """Insert (with retries) and ack the oldest batch_size buffered events."""
        taken = [self._buffer[i] for i in range(min(self.batch_size, len(self._buffer)))]
        if not taken:
            return 0
        rows = await self._insert_with_retry([value for _, value, _ in taken])
        for _ in taken:
            self._buffer.popleft()
        self._space.set()
        self.stats.inserted += rows
        self.stats.duplicates += len(taken) - rows
        for _, _, ack in taken:
            await ack()
        return rows

    async def run(self) -> None:
        """Flush forever; cancel to stop (un-inserted events stay unacked)."""
        while True:
            await self._due()
            await self.flush_once()
