"""Synthetic LLM request traces of workloads other than the shipped one, in the common trace format.

The goodput goal must hold on a trace we do not have, so these stand in for other services'
traffic. Each shape is written down from what such a service is known to look like, before any run
of the bench, and never changed to suit a result:

- `conversation` (a chat assistant): medium prompts (the history resent each turn, lognormal,
  median 1,000 tokens), short answers (median 60), a rate that follows one day's cycle compressed
  into the trace (peak 4x the trough), arrivals Poisson at the rate of the moment;
- `summarization` (documents in, summaries out): long prompts (median 3,000 tokens), long answers
  (median 250), a steady Poisson rate;
- `bursty` (a batch job's or an agent's fan-out beside interactive use): quiet Poisson traffic, and
  bursts of 10-60 requests within a second at random moments; prompts of two kinds (70% short,
  median 150; 30% pasted documents, median 2,500), answers median 30.

Lengths are clipped to [1, 8,000] prompt and [1, 1,000] answer tokens. Pure: numpy's seeded
generator, no clock; the same shape, size and seed give the same file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MAX_PROMPT = 8000
MAX_ANSWER = 1000


@dataclass(frozen=True)
class SynthTrace:
    offset_s: np.ndarray
    prompt: np.ndarray
    answer: np.ndarray


def _lengths(rng: np.random.Generator, n: int, median: float, sigma: float, top: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, size=n)), 1, top).astype(np.int64)


def conversation(n: int, rng: np.random.Generator) -> SynthTrace:
    """Poisson arrivals whose rate follows a day (trough at the start, peak at the middle, 4x)."""
    span_s = 3600.0
    # thinning: candidates at the peak rate, each kept with the rate of its moment over the peak
    peak = n / span_s * 1.6
    times: list[float] = []
    t = 0.0
    while len(times) < n:
        t += rng.exponential(1.0 / peak)
        shape = 0.25 + 0.75 * 0.5 * (1.0 - math.cos(2.0 * math.pi * (t % span_s) / span_s))
        if rng.uniform() < shape:
            times.append(t)
    return SynthTrace(np.asarray(times), _lengths(rng, n, 1000, 0.8, MAX_PROMPT), _lengths(rng, n, 60, 0.9, MAX_ANSWER))


def summarization(n: int, rng: np.random.Generator) -> SynthTrace:
    """A steady Poisson rate, long documents in and long summaries out."""
    times = np.cumsum(rng.exponential(3600.0 / n, size=n))
    return SynthTrace(times, _lengths(rng, n, 3000, 0.5, MAX_PROMPT), _lengths(rng, n, 250, 0.5, MAX_ANSWER))


def bursty(n: int, rng: np.random.Generator) -> SynthTrace:
    """Half the requests quiet Poisson traffic, half in bursts of 10-60 within a second."""
    span_s = 3600.0
    quiet = rng.uniform(0.0, span_s, size=n // 2)
    burst: list[np.ndarray] = []
    left = n - quiet.size
    while left > 0:
        size = min(left, int(rng.integers(10, 61)))
        burst.append(rng.uniform(0.0, span_s) + rng.uniform(0.0, 1.0, size=size))
        left -= size
    times = np.sort(np.concatenate([quiet, *burst]))
    long = rng.uniform(size=n) < 0.3
    prompt = np.where(long, _lengths(rng, n, 2500, 0.6, MAX_PROMPT), _lengths(rng, n, 150, 0.8, MAX_PROMPT))
    return SynthTrace(times - times[0], prompt, _lengths(rng, n, 30, 0.9, MAX_ANSWER))


SHAPES: dict[str, Callable[[int, np.random.Generator], SynthTrace]] = {
    "conversation": conversation,
    "summarization": summarization,
    "bursty": bursty,
}


def synth_trace(shape: str, n: int, seed: int = 0) -> SynthTrace:
    """`n` requests of one of SHAPES, offsets from the first request."""
    if shape not in SHAPES:
        raise ValueError(f"unknown trace shape {shape!r} (known: {', '.join(SHAPES)})")
    if n < 2:
        raise ValueError(f"a trace needs at least 2 requests (got {n})")
    made = SHAPES[shape](n, np.random.default_rng(seed))
    order = np.argsort(made.offset_s, kind="stable")
    offsets = made.offset_s[order]
    return SynthTrace(offsets - offsets[0], made.prompt[order], made.answer[order])
