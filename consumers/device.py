"""The device: each batch runs on a thread of its own, so fetching and deciding go on meanwhile.

One thread per in-flight batch (`BatchProfile.max_inflight_batches`). A
batch runs through `run_isolating`, so one poison request fails alone and
the rest of its batch is answered. Each request goes to the runner with the
deadline the engine holds for it, in absolute form, so generation can stop
a row when it passes. Warm-up runs on the same threads before the consumer
joins its group (`consumers.warm_up`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from consumers.clock import Clock
from consumers.runners.base import MemoryKind, Output, Runner, run_isolating
from consumers.warm_up import warm_up
from pipeline.core.engine.decisions import Batch, PendingRequest
from schemas.messages import Request


@dataclass(frozen=True)
class Ran:
    outputs: dict[int, Output]
    failures: dict[int, str]
    """Index in the batch -> why the runner failed that request alone."""
    memory: tuple[int, MemoryKind]
    """Device memory after the batch: bytes and their kind."""
    start_ms: float
    end_ms: float

    @property
    def compute_ms(self) -> float:
        return self.end_ms - self.start_ms


class Device:
    def __init__(self, runner: Runner, max_inflight: int, clock: Clock, ttft_ms: float | None = None) -> None:
        """`ttft_ms`: the time-to-first-token objective each request's first token is due within (from its
        record time), when its decode loop gives up on what cannot meet it; None: none."""
        self._runner = runner
        self._ttft_ms = ttft_ms
        self._clock = clock
        self._threads = ThreadPoolExecutor(max_inflight, thread_name_prefix="batchtide-device")
        self.computing = 0
        """Batches on the device now: taken at dispatch (`reserve`), freed when `run` ends."""

    async def warm_up(self, model: str, ceiling: int) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, warm_up, self._runner, model, ceiling, self._clock
        )

    def reserve(self) -> None:
        self.computing += 1

    async def run(self, batch: Batch) -> Ran:
        """Run a reserved batch; its slot is free again when this returns or raises."""
        requests = [with_deadline(pr, self._ttft_ms) for pr in batch.requests]
        start = self._clock.now_ms()
        try:
            outputs, failures, memory = await asyncio.get_running_loop().run_in_executor(
                self._threads, self._compute, requests
            )
        finally:
            self.computing -= 1
        return Ran(outputs, failures, memory, start, self._clock.now_ms())

    def close(self) -> None:
        self._threads.shutdown(wait=False)

    def _compute(self, requests: list[Request]) -> tuple[dict[int, Output], dict[int, str], tuple[int, MemoryKind]]:
        outputs, failures = run_isolating(self._runner, requests)
        return outputs, failures, self._runner.device_memory()


def with_deadline(pr: PendingRequest, ttft_ms: float | None = None) -> Request:
    """The request as the runner sees it: with the deadline the engine holds (from timeout_ms or
    the profile's default) in absolute form, and with `ttft_ms` the time its first token is due by
    (record time + the objective) unless it set its own."""
    request: Request = pr.payload.request
    if pr.deadline_ms is not None and request.deadline_ms is None:
        request = msgspec.structs.replace(request, deadline_ms=int(pr.deadline_ms))
    if ttft_ms is not None and request.first_token_deadline_ms is None:
        request = msgspec.structs.replace(request, first_token_deadline_ms=int(pr.enqueue_ms + ttft_ms))
    return request
