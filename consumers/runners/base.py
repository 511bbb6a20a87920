"""The runner contract the consumer loop codes against, and poison isolation.

A runner turns a batch of validated requests into one `Output` per request,
in order. The loop calls `run()` in a worker thread so fetching continues
during compute; a real model's `run()` goes on in a child process
(`device_process`) unless the model's `isolation` says `thread`. A runner
that is not a real model (`simulated=True`) must be labelled as such in
every report that quotes its numbers.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from schemas.messages import Request

if TYPE_CHECKING:
    import psutil

MemoryKind = Literal["cuda_max_allocated", "process_rss", "none"]


@dataclass
class Output:
    """What one request produced: an embedding, or generated text and token ids."""

    embedding: list[float] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    tokens_out: int = 0
    first_token_ms: float | None = None
    """Generation: wall-clock epoch ms when the first token was decoded (its prefill ended): the
    request's time to first token is this less its enqueue time."""
    last_token_ms: float | None = None
    """Generation: epoch ms when its last token was decoded; with first_token_ms, its time per
    output token (iteration-level batching answers a batch when its last request ends)."""
    expired: bool = False
    """Generation stopped at the request's deadline: `text` is what came before it."""
    refused: str | None = None
    """Generation: the decode loop refused it before its prefill, with this reason (expired with no text)."""


@runtime_checkable
class Runner(Protocol):
    name: str
    simulated: bool
    """True for cost-model and zero-cost runners: their numbers are not a model's."""

    def load(self) -> None:
        """Heavy initialisation (weights, tokenizer); idempotent."""

    def measure(self, req: Request) -> tuple[int, int]:
        """(tokens in, expected tokens out) for the `tokens` cost unit; cheap."""

    def check(self, req: Request) -> str | None:
        """Why this request cannot run (e.g. over max_input_tokens), or None."""

    def run(self, reqs: list[Request]) -> list[Output]:
        """Run one batch synchronously; one Output per request, in order."""

    def device_memory(self) -> tuple[int, MemoryKind]:
        """Peak device memory of the last batch in bytes, and what was measured."""

    def close(self) -> None:
        """Release what `load()` took (child processes); the runner is not used after."""


@functools.cache
def _this_process(pid: int) -> psutil.Process:
    import psutil

    return psutil.Process(pid)


def process_rss() -> tuple[int, MemoryKind]:
    """Resident set size of this process: the CPU stand-in for device memory."""
    return _this_process(os.getpid()).memory_info().rss, "process_rss"


def describe_error(error: BaseException, limit: int = 400) -> str:
    """One bounded line naming the exception type, for a DeadLetter detail."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_isolating(runner: Runner, reqs: list[Request]) -> tuple[dict[int, Output], dict[int, str]]:
    """Run a batch; if it raises, bisect to find the request(s) that make it raise.

    Returns outputs by position for the requests that ran, and error text by
    position for the culprits. With k poison requests among n this costs
    O(k log n) runs; a batch with no poison costs exactly one run. A runner
    that returns the wrong number of outputs is treated as raising.
    """
    outputs: dict[int, Output] = {}
    errors: dict[int, str] = {}
    _run_range(runner, reqs, list(range(len(reqs))), outputs, errors)
    return outputs, errors


def _run_range(
    runner: Runner,
    reqs: list[Request],
    positions: list[int],
    outputs: dict[int, Output],
    errors: dict[int, str],
) -> None:
    if not positions:
        return
    try:
        result = runner.run([reqs[i] for i in positions])
        if len(result) != len(positions):
            raise RuntimeError(f"runner returned {len(result)} outputs for {len(positions)} requests")
    except Exception as e:
        if len(positions) == 1:
            errors[positions[0]] = describe_error(e)
            return
        half = len(positions) // 2
        _run_range(runner, reqs, positions[:half], outputs, errors)
        _run_range(runner, reqs, positions[half:], outputs, errors)
        return
    outputs.update(zip(positions, result, strict=True))
