"""LLM request traces: arrival times with prompt and answer lengths, read from a CSV file.

A production trace says when each request came and how many tokens its prompt and answer had;
the prompts' text is not public, nor needed: a scheduler sees only sizes and times. The common
format is a CSV file with a header naming three columns (any order; other columns ignored):

    timestamp,prompt_tokens,answer_tokens
    0.000,1480,13
    0.052,210,7

`timestamp` is seconds (a number) or an ISO 8601 date-time (naive ones are read as UTC); only
differences count. The Azure LLM inference traces' header (`TIMESTAMP,ContextTokens,
GeneratedTokens`) is accepted as the same three columns. Rows may come out of time order: they
are sorted by time, each keeping its request index (its 0-based data row in the file), which a
replay carries through the pipeline so a live answer can be matched to the trace.

A machine smaller than the one the trace was taken on serves a slice of it at a chosen load
(`TraceSlice`): a window of the trace's own time, stretched by a time scale (2 halves the rate)
and with lengths multiplied by a length scale, the answers' by their own scale when given (every
prompt and answer keeps at least one token).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from pipeline.core.sim.generation.decode_loop import GenArrivals

COLUMNS = ("timestamp", "prompt_tokens", "answer_tokens")
"""The common trace format's columns."""
HEADERS: dict[str, tuple[str, str, str]] = {
    "common": COLUMNS,
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
}
"""Accepted headers: the names of the time, prompt-tokens and answer-tokens columns."""


class TraceError(ValueError):
    """A trace file that cannot be read as a trace; the message names the file and the line."""


@dataclass(frozen=True)
class Trace:
    """Requests in time order (parallel arrays)."""

    source: str
    index: np.ndarray
    """Request index in the file (its 0-based data row), whatever the order of the rows."""
    offset_ms: np.ndarray
    """Arrival, ms from the start (the file's first request, or a slice's window start)."""
    prompt: np.ndarray
    answer: np.ndarray

    def __len__(self) -> int:
        return int(self.index.shape[0])

    @property
    def span_s(self) -> float:
        """Seconds from the first request to the last."""
        return float(self.offset_ms[-1] - self.offset_ms[0]) / 1000.0 if len(self) else 0.0

    @property
    def rate_per_s(self) -> float:
        """Mean arrival rate over the trace's span (0 for fewer than two requests)."""
        return (len(self) - 1) / self.span_s if len(self) > 1 and self.span_s > 0 else 0.0


@dataclass(frozen=True)
class TraceSlice:
    """Which part of a trace to serve, and how much lighter."""

    time_scale: float = 1.0
    """Arrival times are multiplied by this: 2 offers the slice at half its rate, over twice the time."""
    length_scale: float = 1.0
    """Prompt and answer tokens are multiplied by this (rounded, at least 1)."""
    start_s: float = 0.0
    """Start of the window, seconds of the trace's own time from its first request."""
    duration_s: float | None = None
    """Length of the window in the trace's own seconds; None: to the end."""
    answer_scale: float | None = None
    """Answer tokens are multiplied by this instead of `length_scale` (a CPU that must shorten the
    prompts can keep the answers, and so the times between their tokens, as they were)."""

    def __post_init__(self) -> None:
        for name in ("time_scale", "length_scale", "answer_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if not (math.isfinite(value) and value > 0):
                raise TraceError(f"{name} must be a positive number (got {value})")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise TraceError(f"start must be seconds >= 0 (got {self.start_s})")
        if self.duration_s is not None and not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise TraceError(f"duration must be seconds > 0 (got {self.duration_s})")

    def describe(self) -> str:
        window = f"{self.start_s:g} s" + (
            f" to {self.start_s + self.duration_s:g} s" if self.duration_s is not None else " to the end"
        )
        answers = "" if self.answer_scale is None else f", answers x{self.answer_scale:g}"
        return f"window {window} of the trace, time x{self.time_scale:g}, lengths x{self.length_scale:g}{answers}"

    def apply(self, trace: Trace) -> Trace:
        """The requests of the window, times from the window's start, scaled."""
        start_ms = self.start_s * 1000.0
        end_ms = math.inf if self.duration_s is None else start_ms + self.duration_s * 1000.0
        keep = (trace.offset_ms >= start_ms) & (trace.offset_ms < end_ms)
        if not keep.any():
            raise TraceError(f"{trace.source}: no request in {self.describe()} (the trace spans {trace.span_s:.1f} s)")
        return Trace(
            trace.source,
            trace.index[keep],
            (trace.offset_ms[keep] - start_ms) * self.time_scale,
            _scaled(trace.prompt[keep], self.length_scale),
            _scaled(trace.answer[keep], self.length_scale if self.answer_scale is None else self.answer_scale),
        )


def _scaled(tokens: np.ndarray, factor: float) -> np.ndarray:
    return np.maximum(np.rint(tokens * factor), 1).astype(np.int64)


def _seconds(raw: str) -> float:
    """A timestamp as seconds: a number, or an ISO 8601 date-time (naive: UTC)."""
    try:
        return float(raw)
    except ValueError:
        pass
    stamp = datetime.fromisoformat(raw.strip())
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def _columns(header: list[str], source: str) -> tuple[int, int, int]:
    names = [h.strip() for h in header]
    for columns in HEADERS.values():
        if all(c in names for c in columns):
            return names.index(columns[0]), names.index(columns[1]), names.index(columns[2])
    accepted = "; ".join(f"{kind}: {','.join(cols)}" for kind, cols in HEADERS.items())
    raise TraceError(f"{source}: line 1: unknown header {','.join(names)!r} (accepted: {accepted})")


def read_trace(path: str | Path) -> Trace:
    """Every request of a trace file, in time order, offsets from its first request."""
    source = str(path)
    try:
        handle = open(path, newline="")
    except OSError as e:
        raise TraceError(f"{source}: cannot read the trace ({e.strerror or e})") from None
    with handle:
        rows = csv.reader(handle)
        try:
            header = next(rows)
        except StopIteration:
            raise TraceError(f"{source}: empty file (a trace starts with a header line)") from None
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{source}: line 1: not a CSV text file ({e})") from None
        at, pi, ai = _columns(header, source)
        width = max(at, pi, ai) + 1
        times: list[float] = []
        prompts: list[int] = []
        answers: list[int] = []
        try:
            for row in rows:
                line = rows.line_num
                if not row or all(not cell.strip() for cell in row):
                    continue
                if len(row) < width:
                    raise TraceError(f"{source}: line {line}: {len(row)} columns, the header has {len(header)}")
                try:
                    t = _seconds(row[at])
                except ValueError:
                    raise TraceError(
                        f"{source}: line {line}: timestamp {row[at]!r} is neither seconds nor an ISO 8601 date-time"
                    ) from None
                if not math.isfinite(t):
                    raise TraceError(f"{source}: line {line}: timestamp {row[at]!r} is not a finite time")
                counts = []
                for column, what in ((pi, "prompt"), (ai, "answer")):
                    try:
                        value = int(row[column])
                    except ValueError:
                        raise TraceError(
                            f"{source}: line {line}: {what} tokens {row[column]!r} is not a whole number"
                        ) from None
                    if value < 0:
                        raise TraceError(f"{source}: line {line}: {what} tokens {value} is negative")
                    counts.append(value)
                times.append(t)
                prompts.append(counts[0])
                answers.append(counts[1])
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{source}: line {rows.line_num}: not a CSV text file ({e})") from None
    if not times:
        raise TraceError(f"{source}: no requests after the header")
    seconds = np.asarray(times, dtype=float)
    order = np.argsort(seconds, kind="stable")
    offset_ms = (seconds[order] - seconds[order[0]]) * 1000.0
    return Trace(
        source,
        order.astype(np.int64),
        offset_ms,
        np.asarray(prompts, dtype=np.int64)[order],
        np.asarray(answers, dtype=np.int64)[order],
    )


def write_trace(path: str | Path, offset_s: np.ndarray, prompt: np.ndarray, answer: np.ndarray) -> Path:
    """A trace file in the common format (tests, and traces made from recordings)."""
    target = Path(path)
    with open(target, "w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(COLUMNS)
        for t, p, a in zip(offset_s.tolist(), prompt.tolist(), answer.tolist(), strict=True):
            out.writerow([f"{t:.6f}", int(p), int(a)])
    return target


def trace_arrivals(trace: Trace) -> GenArrivals:
    """The trace's requests as the generation simulator takes them, as `produce --trace` sends
    them: each asks for exactly its answer's tokens (max_new_tokens, the end-of-sequence ignored)
    and emits them all; one lane, priority 1 (the wire default), no deadline."""
    n = len(trace)
    create = trace.offset_ms.astype(float)
    return GenArrivals(
        create,
        create.copy(),
        trace.prompt.copy(),
        trace.answer.copy(),
        trace.answer.copy(),
        np.ones(n, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.full(n, np.nan),
        exact_answers=True,
    )
