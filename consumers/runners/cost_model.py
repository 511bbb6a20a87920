"""Simulated runners for load tests: a device that costs t(b), and one that costs nothing.

`CostModelRunner` sleeps the batch's compute time t(b) of the simulated device
(pipeline/core/sim/device_curve.py, the curve the simulator charges): the model's
`cost_points` (measured (batch size, ms) pairs, interpolated, extended along
the end segments) or `cost_a_ms + cost_c_ms * b`.
`ZeroCostRunner` returns at once, so a pipeline run with it measures the
pipeline's own overhead. Both are `simulated=True`; their outputs are
deterministic placeholders (an empty embedding, `text` = ``"[simulated]"``)
so a client can never mistake them for a model's answer.

Test hooks: with `poison_marker` set, a request whose text contains the marker
makes `run()` raise, as a real model would on an input it cannot handle. It is
off unless a test or `batchtide chaos` turns it on. With the environment
variable `BATCHTIDE_COST_SLOWDOWN_FILE` naming a file that holds
`FROM_MS TO_MS FACTOR` (wall-clock epoch ms), batches that start inside that
window cost FACTOR times more: a device that throttles mid-run
(`bench fleet`). The file may appear or change while the runner runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Final

from pipeline.core.config import ModelConfig
from pipeline.core.sim.device_curve import DeviceCurve
from schemas.messages import Request

from .base import MemoryKind, Output, process_rss

SIMULATED_TEXT: Final = "[simulated]"
POISON_MARKER: Final = "__poison__"
"""The marker tests put into a request's text when the hook is on."""
SLOWDOWN_FILE_ENV: Final = "BATCHTIDE_COST_SLOWDOWN_FILE"
SLOWDOWN_REREAD_S = 0.5


class PoisonError(RuntimeError):
    """Raised by the simulated runners' test hook on a marked request."""


def estimate_tokens(req: Request) -> int:
    """Token count without a tokenizer: ids as given, ~4 characters per token of text."""
    if req.token_ids is not None:
        return len(req.token_ids)
    return max(1, (len(req.text or "") + 3) // 4)


def _requested_new_tokens(req: Request, cap: int) -> int:
    return min(req.params.max_new_tokens, cap) if req.params is not None else 0


class SlowdownHook:
    """The slowdown hook: the factor in force now, from a file re-read at most every SLOWDOWN_REREAD_S."""

    def __init__(self, path: str | None) -> None:
        self._path = Path(path) if path else None
        self._window = (0.0, 0.0, 1.0)
        self._read_at = -SLOWDOWN_REREAD_S

    def factor(self) -> float:
        if self._path is None:
            return 1.0
        now = time.monotonic()
        if now - self._read_at >= SLOWDOWN_REREAD_S:
            self._read_at = now
            try:
                start, end, factor = (float(v) for v in self._path.read_text().split())
                self._window = (start, end, factor)
            except (OSError, ValueError):
                self._window = (0.0, 0.0, 1.0)
        start, end, factor = self._window
        return factor if start <= time.time() * 1000.0 < end else 1.0


class ZeroCostRunner:
    """Returns placeholders at once: measures the pipeline, not a model."""

    simulated = True

    def __init__(self, model: ModelConfig, *, poison_marker: str | None = None) -> None:
        self.name = model.name
        self._config = model
        self._poison_marker = poison_marker

    def load(self) -> None:
        return None

    def measure(self, req: Request) -> tuple[int, int]:
        return estimate_tokens(req), _requested_new_tokens(req, self._config.max_new_tokens)

    def check(self, req: Request) -> str | None:
        tokens = estimate_tokens(req)
        if tokens > self._config.max_input_tokens:
            return f"input is ~{tokens} tokens; max_input_tokens is {self._config.max_input_tokens}"
        return None

    def run(self, reqs: list[Request]) -> list[Output]:
        self._raise_on_poison(reqs)
        return [self._placeholder(r) for r in reqs]

    def device_memory(self) -> tuple[int, MemoryKind]:
        return process_rss()

    def close(self) -> None:
        return None

    def _raise_on_poison(self, reqs: list[Request]) -> None:
        marker = self._poison_marker
        if marker is None:
            return
        for r in reqs:
            if r.text is not None and marker in r.text:
                raise PoisonError(f"simulated runner refused request {r.id!r} (test hook: text contains {marker!r})")

    def _placeholder(self, req: Request) -> Output:
        new_tokens = _requested_new_tokens(req, self._config.max_new_tokens)
        return Output(embedding=[], text=SIMULATED_TEXT, tokens_out=new_tokens)


class CostModelRunner(ZeroCostRunner):
    """Sleeps t(b) per batch, b in the profile's cost unit: a device that is busy but computes nothing."""

    def __init__(self, model: ModelConfig, *, poison_marker: str | None = None) -> None:
        super().__init__(model, poison_marker=poison_marker)
        self.curve = DeviceCurve(a_ms=model.cost_a_ms, c_ms=model.cost_c_ms, points=model.cost_points)
        self._tokens = model.profile.cost_unit == "tokens"
        self._slowdown = SlowdownHook(os.environ.get(SLOWDOWN_FILE_ENV))

    def batch_cost(self, reqs: list[Request]) -> float:
        """Batch size in the profile's cost unit (requests, or tokens in + out)."""
        if not self._tokens:
            return float(len(reqs))
        return float(sum(sum(self.measure(r)) for r in reqs))

    def run(self, reqs: list[Request]) -> list[Output]:
        deadline = time.perf_counter() + self.curve.ms(self.batch_cost(reqs)) * self._slowdown.factor() / 1000.0
        self._raise_on_poison(reqs)
        outputs = [self._placeholder(r) for r in reqs]
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return outputs
