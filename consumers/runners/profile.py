"""Measure a model on its device: t(b) and peak memory at doubling sizes, until something gives.

Embedding models (and simulated runners): whole batches of ~`tokens`-token
texts at b = 1, 2, 4, ... Generation: per batch size, one prefill of
`tokens`-token prompts (the prefill curve, over prompt tokens in the batch)
and `decode_steps` decode steps on the running set it leaves (the
decode-step curve, per batch size and cache length); then one request at
the longest prompt the model admits (its `max_input_tokens`, lowered to its
position table), so the profile knows what the longest admissible request
costs and whether the device holds it. Doubling stops when
the next size would not fit the memory limit (the device's memory less
headroom), when the device runs out of memory (caught), when a batch (a
decode step, for generation) takes longer than the compute budget, or at
`max_size`.

Peak memory: `torch.cuda.max_memory_allocated` on CUDA (reset per size);
on CPU the growth of the process's peak RSS over what the loaded model held
(`ru_maxrss`), an upper bound that never goes down.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas.messages import GenerationParams, Request

from .base import Runner

WORDS = (
    "stream batch kafka latency window model token request result queue burst "
    "memory device consumer partition offset tail marked priority deadline"
).split()
KNEE_TOLERANCE = 0.02
"""A doubling must raise throughput by more than this share to move the knee (the engine's default)."""


@dataclass(frozen=True)
class Point:
    """One measured size."""

    size: int
    """Batch size in requests."""
    tokens: int
    """Tokens in the batch: input tokens (embed, prefill), or cache tokens per row (decode)."""
    median_ms: float
    p90_ms: float
    items_per_s: float
    tokens_per_s: float
    """Input tokens/s (embed, prefill) or generated tokens/s (decode)."""
    peak_bytes: int
    runs: int


@dataclass
class Measurement:
    """What a profile run found."""

    task: str
    device: str
    memory_kind: str
    memory_limit_bytes: int
    """Device memory the batches may use: total (CUDA) or available (CPU) at start, less headroom."""
    base_bytes: int
    """Memory held before the first batch (weights, allocator)."""
    budget_ms: float
    points: list[Point] = field(default_factory=list)
    """Whole batches (embed), or decode steps (generate)."""
    prefill: list[Point] = field(default_factory=list)
    """Generation: one prefill of `size` prompts."""
    stop_reason: str = "max_size"
    """Why doubling stopped: memory, oom, budget or max_size."""
    prompt_tokens: int = 0
    decode_steps: int = 0
    max_prompt_tokens: int = 0
    """Generation: the longest prompt the model admits (what `check()` lets through)."""
    longest: list[Point] = field(default_factory=list)
    """Generation: one request at `max_prompt_tokens`, its prefill and its decode step; empty
    when the device ran out of memory on it (the config admits a request the device cannot hold)."""


def texts_of_about(runner: Runner, tokens: int, count: int, new_tokens: int) -> list[Request]:
    """`count` distinct texts whose measured input length is about `tokens`."""
    params = GenerationParams(max_new_tokens=new_tokens)
    reqs: list[Request] = []
    for i in range(count):
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(tokens)]
        for n in range(tokens, 0, -1):
            req = Request(id=f"p{i}-{n}", model=runner.name, text=" ".join(words[:n]), params=params)
            if runner.measure(req)[0] <= tokens:
                break
        reqs.append(req)
    return reqs


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class DeviceMemory:
    """Peak memory per size, and the limit, for CUDA or CPU."""

    def __init__(self, device: str, headroom: float) -> None:
        import psutil

        self.device = device
        self.cuda = device.startswith("cuda")
        if self.cuda:
            import torch

            _, total = torch.cuda.mem_get_info(device)
            self.kind = "cuda_max_allocated"
            self.base = int(torch.cuda.memory_allocated(device))
            self.limit = int(total * (1.0 - headroom))
        else:
            self.kind = "process_rss"
            self.base = _peak_rss_bytes()
            self.limit = int(psutil.virtual_memory().available * (1.0 - headroom)) + self.base

    def reset(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        """Peak bytes above what the loaded model held, since the last reset (CPU: ever)."""
        if self.cuda:
            import torch

            return max(0, int(torch.cuda.max_memory_allocated(self.device)) - self.base)
        return max(0, _peak_rss_bytes() - self.base)

    def fits(self, next_bytes: float) -> bool:
        return self.base + next_bytes <= self.limit


def is_oom(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or "out of memory" in str(error).lower()


def _timed(fn: Callable[[], Any], seconds: float, min_runs: int) -> list[float]:
    fn()  # warm-up: allocator growth, page faults, kernel choice
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < min_runs or time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return times


def _p90(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[math.ceil(0.9 * (len(ordered) - 1))]


def sizes_up_to(max_size: int) -> list[int]:
    sizes, b = [], 1
    while b <= max_size:
        sizes.append(b)
        b *= 2
    return sizes


def measure_batches(
    runner: Runner,
    *,
    device: str,
    tokens: int,
    max_size: int,
    budget_ms: float,
    headroom: float,
    seconds: float,
    min_runs: int = 3,
    on_point: Callable[[str], None] = lambda _: None,
) -> Measurement:
    """Whole batches at doubling sizes (embedding models, simulated runners)."""
    pool = texts_of_about(runner, tokens, max_size, 1)
    tokens_of = [runner.measure(r)[0] for r in pool]
    memory = DeviceMemory(device, headroom)
    found = Measurement("embed", device, memory.kind, memory.limit, memory.base, budget_ms)
    for b in sizes_up_to(max_size):
        memory.reset()
        try:
            times = _timed(functools.partial(runner.run, pool[:b]), seconds, min_runs)
        except Exception as e:
            if is_oom(e):
                found.stop_reason = "oom"
                break
            raise
        in_tokens = sum(tokens_of[:b])
        point = _point(b, in_tokens, times, in_tokens, memory.peak())
        found.points.append(point)
        on_point(f"b={b}: {point.median_ms:.1f} ms")
        if _stops(found, point, memory):
            break
    return found


def measure_generation(
    runner: Any,
    *,
    device: str,
    tokens: int,
    decode_steps: int,
    max_size: int,
    budget_ms: float,
    headroom: float,
    repeats: int = 2,
    on_point: Callable[[str], None] = lambda _: None,
) -> Measurement:
    """Prefill and decode-step curves of a transformers causal LM (`TransformersRunner`)."""
    import torch

    from .decoding import Sequence

    runner.load()
    pool = texts_of_about(runner, tokens, max_size, decode_steps)
    prompts = [runner._ids(r) for r in pool]
    memory = DeviceMemory(device, headroom)
    found = Measurement(
        "generate",
        device,
        memory.kind,
        memory.limit,
        memory.base,
        budget_ms,
        prompt_tokens=tokens,
        decode_steps=decode_steps,
    )
    big = 1 << 30  # rows never end on their own: every step decodes the whole batch
    with torch.inference_mode():
        for b in sizes_up_to(max_size):
            memory.reset()
            prefill_ms: list[float] = []
            step_ms: list[float] = []
            cache = 0
            try:
                for _ in range(repeats + 1):  # the first round warms this size up
                    running = runner._running_set()
                    running.stop_ids = frozenset()
                    seqs = [Sequence(p, big) for p in prompts[:b]]
                    start = time.perf_counter()
                    running.join(seqs)
                    prefill_ms.append((time.perf_counter() - start) * 1000.0)
                    for _ in range(decode_steps):
                        start = time.perf_counter()
                        running.step()
                        step_ms.append((time.perf_counter() - start) * 1000.0)
                    cache = running.cache_tokens
                    del running, seqs
            except Exception as e:
                if is_oom(e):
                    found.stop_reason = "oom"
                    break
                raise
            prompt_total = sum(len(p) for p in prompts[:b])
            peak = memory.peak()
            prefill = _point(b, prompt_total, prefill_ms[1:], prompt_total, peak)
            step = _point(b, cache - decode_steps // 2, step_ms[decode_steps:], b, peak)
            found.prefill.append(prefill)
            found.points.append(step)
            on_point(f"b={b}: prefill {prefill.median_ms:.0f} ms, step {step.median_ms:.1f} ms")
            if _stops(found, step, memory):
                break
        found.max_prompt_tokens = runner.max_input_tokens
        found.longest = _longest_request(runner, found.max_prompt_tokens, decode_steps, repeats, memory)
    return found


def _longest_request(
    runner: Any, prompt_tokens: int, decode_steps: int, repeats: int, memory: DeviceMemory
) -> list[Point]:
    """Prefill and decode step of one request at the longest admissible prompt; [] on OOM."""
    from .decoding import Sequence

    words = " ".join(WORDS[k % len(WORDS)] for k in range(prompt_tokens))
    ids = runner._tokenize([words])[0]
    prompt = (ids * (prompt_tokens // max(len(ids), 1) + 1))[:prompt_tokens]
    memory.reset()
    prefill_ms: list[float] = []
    step_ms: list[float] = []
    try:
        for _ in range(repeats + 1):
            running = runner._running_set()
            running.stop_ids = frozenset()
            start = time.perf_counter()
            running.join([Sequence(prompt, 1 << 30)])
            prefill_ms.append((time.perf_counter() - start) * 1000.0)
            for _ in range(decode_steps):
                start = time.perf_counter()
                running.step()
                step_ms.append((time.perf_counter() - start) * 1000.0)
            del running
    except Exception as e:
        if is_oom(e):
            return []
        raise
    peak = memory.peak()
    return [
        _point(1, prompt_tokens, prefill_ms[1:], prompt_tokens, peak),
        _point(1, prompt_tokens + decode_steps // 2, step_ms[decode_steps:], 1, peak),
    ]


def _point(size: int, tokens: int, times: list[float], per_run: int, peak: int) -> Point:
    """A size's timings; `per_run` is what one run produces (input tokens, or generated tokens)."""
    median = statistics.median(times)
    return Point(size, tokens, median, _p90(times), size * 1000 / median, per_run * 1000 / median, peak, len(times))


def _stops(found: Measurement, point: Point, memory: DeviceMemory) -> bool:
    """Doubling ends past the compute budget, or when twice this size's memory would not fit."""
    if point.median_ms > found.budget_ms:
        found.stop_reason = "budget"
    elif not memory.fits(point.peak_bytes * 2):
        found.stop_reason = "memory"
    else:
        return False
    return True


def knee(points: list[Point], tolerance: float = KNEE_TOLERANCE) -> int:
    """The smallest size maximising log(throughput) less `tolerance` per doubling (the engine's rule)."""
    penalty = math.log(1.0 + tolerance) / math.log(2.0)
    best, best_score = 1, -math.inf
    for p in points:
        score = math.log(p.items_per_s) - penalty * math.log(p.size)
        if score > best_score + 1e-12:
            best, best_score = p.size, score
    return best


def bytes_per_unit(found: Measurement) -> float:
    """Memory one more unit costs (request, or KV token for generation): the growth between the two
    largest sizes (what the first batch pages in once, e.g. weights, is not per unit)."""
    if not found.points:
        return 0.0

    def units(p: Point) -> int:
        return p.size * (found.prompt_tokens + found.decode_steps) if found.task == "generate" else p.size

    last = found.points[-1]
    if len(found.points) >= 2:
        before = found.points[-2]
        grew = last.peak_bytes - before.peak_bytes
        if grew > 0:
            return grew / max(units(last) - units(before), 1)
    return last.peak_bytes / max(units(last), 1)


def memory_limit_units(found: Measurement) -> int | None:
    """Largest size (requests, or KV tokens for generation) that fits the memory limit; None if unmeasurable."""
    per_unit = bytes_per_unit(found)
    if per_unit <= 0:
        return None
    return max(1, int((found.memory_limit_bytes - found.base_bytes) / per_unit))


def machine_info() -> dict[str, Any]:
    load = os.getloadavg()[0]
    return {"cpus": os.cpu_count() or 1, "load_avg": round(load, 2)}
