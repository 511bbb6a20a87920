"""What the consumers' latency events tell about a trial: where a request's time went (stage by
stage), batch sizes, tokens, and for generation the time to first token and per output token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.config import KafkaSettings
from pipeline.tools.bench.pipeline.lengths import LONG_PROMPT
from pipeline.tools.harness.events import latency_events


def percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


STAGES = {
    "kafka_in": ("enqueue_ms", "fetch_ms"),
    "queued": ("fetch_ms", "dispatch_ms"),
    "to_thread": ("dispatch_ms", "compute_start_ms"),
    "compute": ("compute_start_ms", "compute_end_ms"),
    "to_outbox": ("compute_end_ms", "produce_ms"),
    "kafka_out": ("produce_ms", "received_ms"),
}
"""Where a request's time goes: the consumer's stamps, then the client's arrival stamp (one host, one clock)."""


@dataclass
class EventFigures:
    tokens: int = 0
    tokens_out: int = 0
    mean_batch: float = float("nan")
    stages_p50_ms: dict[str, float] = field(default_factory=dict)
    stages_p99_ms: dict[str, float] = field(default_factory=dict)
    ttft_ms: tuple[float, float] = (float("nan"), float("nan"))
    """Generation: p50, p99 of first token - enqueue over the requests that generated."""
    long_ttft_p99_ms: float = float("nan")
    """Generation: TTFT p99 over those with a long prompt (`long_prompt`): what chunking costs them."""
    tpot_ms: tuple[float, float] = (float("nan"), float("nan"))
    """Generation: p50, p99 of (last - first token) / (tokens_out - 1) over those with two tokens or more."""
    window_tokens_out: int = 0
    """Generation: tokens generated inside the measurement window (`tokens_in_window`)."""
    meeting_objectives: int = 0
    """Generation: answered `ok` within both the TTFT and the TPOT objective (`meets_objectives`)."""
    by_consumer: dict[str, dict[str, float]] = field(default_factory=dict)
    """Generation: per answering consumer, TTFT and TPOT p99 (`ttft_p99_ms`, `tpot_p99_ms`) and the tokens
    it generated inside the measurement window (`window_tokens_out`)."""


def tokens_in_window(rows: list[dict[str, Any]], start_ms: float, end_ms: float) -> int:
    """Generated tokens stamped inside [start_ms, end_ms): each request's first token at its
    first_token_ms, the rest evenly up to its last_token_ms (events without stamps count none)."""
    count = 0
    for r in rows:
        n, first, last = r.get("tokens_out") or 0, r.get("first_token_ms"), r.get("last_token_ms")
        if n <= 0 or first is None:
            continue
        times = first + np.arange(n) * ((last - first) / (n - 1) if n > 1 and last is not None else 0.0)
        count += int(np.count_nonzero((times >= start_ms) & (times < end_ms)))
    return count


def token_timing(rows: list[dict[str, Any]]) -> tuple[tuple[float, float], tuple[float, float]]:
    """TTFT and TPOT p50/p99 from latency events (events without token stamps are left out)."""
    generated = [r for r in rows if r.get("first_token_ms")]
    ttft = np.array([r["first_token_ms"] - r["enqueue_ms"] for r in generated])
    tpot = np.array(
        [(r["last_token_ms"] - r["first_token_ms"]) / (r["tokens_out"] - 1) for r in generated if r["tokens_out"] > 1]
    )
    return (percentile(ttft, 50), percentile(ttft, 99)), (percentile(tpot, 50), percentile(tpot, 99))


def long_prompt(row: dict[str, Any]) -> bool:
    """A prompt of at least half LONG_PROMPT tokens (the `long` mix's; the others' are far shorter)."""
    return (row.get("tokens_in") or 0) >= LONG_PROMPT // 2


def long_ttft_p99(rows: list[dict[str, Any]]) -> float:
    """TTFT p99 of the requests with a long prompt that generated (nan when there are none)."""
    return percentile(
        np.array([r["first_token_ms"] - r["enqueue_ms"] for r in rows if r.get("first_token_ms") and long_prompt(r)]),
        99,
    )


def meets_objectives(row: dict[str, Any], ttft_ms: float, tpot_ms: float) -> bool:
    """Whether a request was answered `ok` with its first token within `ttft_ms` of its record time
    and its later tokens `tpot_ms` apart on average (the goodput of DistServe and Sarathi-Serve)."""
    first, n = row.get("first_token_ms"), row.get("tokens_out") or 0
    if row.get("outcome", "ok") != "ok" or not first or n < 1 or first - row["enqueue_ms"] > ttft_ms:
        return False
    return n == 1 or (row["last_token_ms"] - first) / (n - 1) <= tpot_ms


async def event_figures(
    kafka: KafkaSettings,
    received_ms: dict[str, float],
    timeout_s: float = 20.0,
    window_ms: tuple[float, float] | None = None,
    objectives: tuple[float, float] | None = None,
) -> EventFigures:
    """Tokens, batch sizes and per-stage latency of the answered requests (id -> client arrival
    stamp), from the consumers' latency events."""
    events = await latency_events(kafka, received_ms, timeout_s)
    if not events:
        return EventFigures()
    rows = [event | {"received_ms": received_ms[rid]} for rid, event in events.items()]
    spans = {name: np.array([r[end] - r[start] for r in rows]) for name, (start, end) in STAGES.items()}
    ttft, tpot = token_timing(rows)
    return EventFigures(
        ttft_ms=ttft,
        long_ttft_p99_ms=long_ttft_p99(rows),
        tpot_ms=tpot,
        tokens=sum(r["tokens_in"] + r["tokens_out"] for r in rows),
        tokens_out=sum(r["tokens_out"] for r in rows),
        mean_batch=float(np.mean([r["batch_size"] for r in rows])),
        stages_p50_ms={name: percentile(v, 50) for name, v in spans.items()},
        stages_p99_ms={name: percentile(v, 99) for name, v in spans.items()},
        window_tokens_out=tokens_in_window(rows, *window_ms) if window_ms else 0,
        meeting_objectives=sum(meets_objectives(r, *objectives) for r in rows) if objectives else 0,
        by_consumer=per_consumer(rows, window_ms) if window_ms else {},
    )


def per_consumer(rows: list[dict[str, Any]], window_ms: tuple[float, float]) -> dict[str, dict[str, float]]:
    """TTFT and TPOT p99 and the tokens generated inside `window_ms`, of each consumer's answers."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r.get("consumer_id") or "", []).append(r)
    figures = {}
    for name, own in sorted(groups.items()):
        ttft, tpot = token_timing(own)
        figures[name] = {
            "ttft_p99_ms": ttft[1],
            "tpot_p99_ms": tpot[1],
            "window_tokens_out": float(tokens_in_window(own, *window_ms)),
        }
    return figures
