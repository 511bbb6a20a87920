"""Deterministic synthetic latency data: realistic rows for tests, boards and benchmarks.

The same (rows, seed, models, start, duration) always gives the same rows.
Each model gets a load curve (a slow swell plus bursts), batches are placed
in time in proportion to the load, their sizes follow the arrival rate up to
the hard cap, and requests inside a batch get waits from the window, the
queue ahead of them and a rare long tail. Requests waiting more than twice
the model's median wait are tail-marked, as the engine would. One model gets
~50% heavier per batch late in the range, the "heavier model shipped" story
of the field report, so the compute-by-batch-size panels have something to show.

Generation is vectorised (numpy) and chunked, so 10 million rows stay cheap.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from clickhouse_connect.driver.client import Client

from pipeline.core.store.writer import BATCH_COLUMNS, LATENCY_COLUMNS, NO_BATCH_ID
from schemas.messages import BatchEvent, LatencyEvent

DEFAULT_MODELS = ("minilm", "smollm")
CHUNK_ROWS = 500_000
TARGET_SIZE = 32
HARD_CAP = 48


@dataclass(frozen=True)
class ModelShape:
    """How one synthetic model behaves: cost curve, load, tokens and memory."""

    cost_a_ms: float
    cost_c_ms: float
    tokens_in: tuple[int, int]
    tokens_out: tuple[int, int]
    mem_kind: str
    mem_base_bytes: int
    mem_per_request_bytes: int
    heavier_after: float | None = None
    """Share of the range after which the per-batch cost grows by half (None: never)."""


SHAPES = (
    ModelShape(8.0, 0.9, (16, 64), (0, 0), "process_rss", 600 << 20, 2 << 20),
    ModelShape(40.0, 4.0, (20, 200), (8, 32), "cuda_max_allocated", 2 << 30, 40 << 20, heavier_after=0.7),
)


@dataclass(frozen=True)
class FleetSeed:
    """Opt-in departures from the plain seed, for the fleet and refusal views (the defaults change nothing).

    `slow_factor` multiplies the per-batch compute and the queue waits of each model's second consumer
    (`<model>-c1`): one slow device in a group of two. `refused_share` adds that share of extra requests
    refused before they ran (outcome `rejected`, no batch: stored as NO_BATCH_ID, batch_size 0, no compute),
    with `REFUSAL_REASONS`."""

    slow_factor: float = 1.0
    refused_share: float = 0.0


REFUSAL_REASONS = ("too_long", "schema")


@dataclass(frozen=True)
class SeedChunk:
    """Column-oriented rows for the two raw tables, in LATENCY_COLUMNS / BATCH_COLUMNS order."""

    latency: dict[str, Any]
    batches: dict[str, Any]

    @property
    def rows(self) -> int:
        return len(self.latency["request_id"])


@dataclass(frozen=True)
class SeedSummary:
    rows: int
    batches: int
    models: tuple[str, ...]
    time_from_ms: int
    time_to_ms: int


def recent_start_ms(duration_ms: int) -> int:
    """A range start such that the range ends at the start of the current minute."""
    return (int(time.time()) // 60) * 60_000 - duration_ms


def _load_curve(mean_rate: float, seconds: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Arrival rate per second of the range: a swell between idle and busy, plus bursts.

    Scaled so its mean is `mean_rate` (rows / duration): the rates recorded
    in batch events agree with the row density a report measures.
    """
    swell = 0.55 + 0.45 * np.sin(2 * np.pi * seconds / 900.0)
    bursts = (rng.random(len(seconds)) < 0.02) * rng.uniform(1.0, 2.5, len(seconds))
    curve = 0.08 + swell + bursts
    rates: np.ndarray = mean_rate * curve / curve.mean()
    return rates


def _model_chunk(
    name: str, shape: ModelShape, rows: int, start_ms: int, duration_ms: int,
    range_start_ms: int, range_ms: int, first_batch: int, first_row: int, seed: int, rng: np.random.Generator,
    fleet: FleetSeed = FleetSeed(),
) -> SeedChunk:  # fmt: skip
    seconds = max(duration_ms // 1000, 1)
    rate = _load_curve(rows / seconds, (start_ms - range_start_ms) / 1000 + np.arange(seconds), rng)
    window = np.where(rate * (shape.cost_a_ms + 20) / 1000 >= TARGET_SIZE, 16.0, 20.0)
    expected_size = np.clip(rate * (shape.cost_a_ms + shape.cost_c_ms * TARGET_SIZE + window) / 1000, 1, HARD_CAP)
    weights = rate / expected_size
    n_batches = int(1.5 * rows / float(np.average(expected_size, weights=weights))) + 16
    while True:
        cells = np.sort(rng.choice(seconds, size=n_batches, p=weights / weights.sum()))
        size = np.clip(rng.poisson(expected_size[cells]), 1, HARD_CAP)
        cumulative = np.cumsum(size)
        if cumulative[-1] >= rows:
            break
        n_batches *= 2
    dispatch = start_ms + cells * 1000 + rng.integers(0, 1000, n_batches)
    dispatch.sort()
    lam = rate[cells]
    # Keep a random subset of the batches (not a time prefix) so the rows span the whole range.
    order = rng.permutation(n_batches)
    taken = int(np.searchsorted(np.cumsum(size[order]), rows)) + 1
    chosen = np.sort(order[:taken])
    surplus = int(size[chosen].sum()) - rows
    dispatch, lam, size, cells = dispatch[chosen], lam[chosen], size[chosen], cells[chosen]
    keep = len(chosen)
    size[int(np.searchsorted(chosen, order[taken - 1]))] -= surplus
    heavier: float | np.ndarray = 1.0
    if shape.heavier_after is not None:
        heavier = np.where(dispatch - range_start_ms > shape.heavier_after * range_ms, 1.5, 1.0)
    consumer = np.arange(keep) % 2
    slow = np.where(consumer == 1, fleet.slow_factor, 1.0)
    compute = np.round((shape.cost_a_ms + shape.cost_c_ms * size) * heavier * slow * rng.uniform(0.9, 1.15, keep), 1)
    busy = lam * (compute + window[cells]) / 1000 >= TARGET_SIZE
    win = np.where(busy, rng.uniform(12, 20, keep), rng.uniform(0, 20, keep)).round(1)
    reason = np.where(size >= HARD_CAP, "hard_cap", np.where(size >= TARGET_SIZE, "target",
                      np.where(rng.random(keep) < 0.7, "max_wait", "idle")))  # fmt: skip
    win = np.where(reason == "idle", 0.0, win)

    n = rows
    batch_of = np.repeat(np.arange(keep), size)
    queue_mean = np.where(busy, np.minimum(compute * 0.08, 4.0), 2.0)[batch_of]
    wait = rng.uniform(0.6, 1.0, n) * win[batch_of] + rng.exponential(queue_mean)
    tail = rng.random(n) < 0.012
    wait = wait + tail * rng.lognormal(np.log(450.0), 0.7, n)
    wait = np.round(wait * slow[batch_of]).astype(np.int64)
    marked = wait > 2 * max(float(np.median(wait)), 1.0)
    starts = np.concatenate(([0], np.cumsum(size)[:-1]))
    batch_id = first_batch + np.arange(keep) // 2
    tok_in = rng.integers(shape.tokens_in[0], shape.tokens_in[1] + 1, n)
    tok_out = (
        rng.integers(shape.tokens_out[0], shape.tokens_out[1] + 1, n) if shape.tokens_out[1] else np.zeros(n, np.int64)
    )
    mem = (shape.mem_base_bytes + shape.mem_per_request_bytes * size * rng.uniform(0.95, 1.05, keep)).astype(np.int64)
    row_index = first_row + np.arange(n)

    dispatch_r = dispatch[batch_of]
    enqueue = dispatch_r - wait
    fetch = np.minimum(enqueue + rng.integers(0, 3, n), dispatch_r)
    compute_start = dispatch + rng.integers(0, 2, keep)
    compute_end = compute_start + np.ceil(compute).astype(np.int64)
    produce = compute_end + rng.integers(1, 4, keep)
    outcome_draw = rng.random(n)
    ok = outcome_draw < 0.995
    first_token, last_token = _token_times(compute_start, compute_end, tok_out, starts, batch_of, ok & (tok_out > 0))
    priority = np.where(rng.random(n) < 0.05, 0, np.where(rng.random(n) < 0.1, 2, 1))
    consumers = np.array([f"{name}-c0", f"{name}-c1"], dtype=object)
    marked_count = np.add.reduceat(marked.astype(np.int64), starts)
    oldest = np.maximum.reduceat(wait, starts)

    latency = {
        "request_id": [f"{name}-{seed}-{i:010d}" for i in row_index.tolist()],
        "model": [name] * n,
        "consumer_id": consumers[consumer[batch_of]].tolist(),
        "outcome": np.where(ok, "ok", np.where(outcome_draw < 0.998, "expired", "error")).tolist(),
        "enqueue_time": enqueue.tolist(),
        "fetch_time": fetch.tolist(),
        "dispatch_time": dispatch_r.tolist(),
        "compute_start_time": compute_start[batch_of].tolist(),
        "compute_end_time": compute_end[batch_of].tolist(),
        "produce_time": produce[batch_of].tolist(),
        "wait_ms": wait.astype(np.float64),
        "compute_ms": compute[batch_of],
        "e2e_ms": (produce[batch_of] - enqueue).astype(np.float64),
        "batch_id": batch_id[batch_of],
        "batch_size": size[batch_of],
        "tail_marked": marked,
        "priority": priority,
        "tokens_in": tok_in,
        "tokens_out": tok_out,
        "device_mem_bytes": mem[batch_of],
        "device_mem_kind": [shape.mem_kind] * n,
        "kafka_partition": (consumer[batch_of] + 2 * (row_index % 2)),
        "kafka_offset": row_index // 4,
        "forwarded": marked & (rng.random(n) < 0.02),
        "schema_version": np.ones(n, np.int64),
        "warmup": np.zeros(n, bool),
        "first_token_time": first_token.tolist(),
        "last_token_time": last_token.tolist(),
        "reason": np.where(ok, "", np.where(outcome_draw < 0.998, "deadline", "runner_error")).tolist(),
        "trace_index": np.full(n, -1, np.int64),
    }
    batches = {
        "batch_id": batch_id,
        "model": [name] * keep,
        "consumer_id": consumers[consumer].tolist(),
        "dispatch_time": dispatch.tolist(),
        "size": size,
        "cost": size,
        "reason": reason.tolist(),
        "window_ms": win,
        "hit_target": size >= TARGET_SIZE,
        "target_size": np.full(keep, TARGET_SIZE),
        "marked_count": marked_count,
        "oldest_wait_ms": oldest.astype(np.float64),
        "queue_depth": rng.poisson(lam * compute / 1000),
        "effective_cap": np.full(keep, HARD_CAP),
        "cap_reason": ["configured"] * keep,
        "arrival_rate_per_s": lam.round(1),
        "compute_ms": compute,
        "tokens_in": np.add.reduceat(tok_in, starts),
        "tokens_out": np.add.reduceat(tok_out, starts),
        "device_mem_bytes": mem,
        "device_mem_kind": [shape.mem_kind] * keep,
        "schema_version": np.ones(keep, np.int64),
    }
    if fleet.refused_share > 0:
        _add_refusals(latency, fleet.refused_share, np.random.default_rng([seed, first_row, 1]))
    return SeedChunk(latency=latency, batches=batches)


def _add_refusals(latency: dict[str, Any], share: float, rng: np.random.Generator) -> None:
    """Append refused requests: copies of random rows' arrival, answered 1-3 ms after their fetch, never run."""
    n = len(latency["request_id"])
    extra = round(n * share)
    if extra == 0:
        return
    pick = rng.choice(n, size=extra, replace=False)
    fetch = np.asarray(latency["fetch_time"])[pick]
    enqueue = np.asarray(latency["enqueue_time"])[pick]
    answered = fetch + rng.integers(1, 4, extra)
    zeros = np.zeros(extra, np.int64)
    refused = {
        "request_id": [f"{latency['request_id'][i]}-refused" for i in pick.tolist()],
        "outcome": ["rejected"] * extra,
        "reason": [REFUSAL_REASONS[i % len(REFUSAL_REASONS)] for i in range(extra)],
        "dispatch_time": answered,
        "compute_start_time": answered,
        "compute_end_time": answered,
        "produce_time": answered,
        "wait_ms": zeros.astype(np.float64),
        "compute_ms": zeros.astype(np.float64),
        "e2e_ms": (answered - enqueue).astype(np.float64),
        "batch_id": zeros + NO_BATCH_ID,
        "batch_size": zeros,
        "tail_marked": zeros.astype(bool),
        "tokens_out": zeros,
        "device_mem_bytes": zeros,
        "device_mem_kind": ["none"] * extra,
        "forwarded": zeros.astype(bool),
        "first_token_time": zeros,
        "last_token_time": zeros,
    }
    for column, values in list(latency.items()):
        added = refused.get(column)
        if added is None:
            added = np.asarray(values)[pick] if isinstance(values, np.ndarray) else [values[i] for i in pick.tolist()]
        if isinstance(values, np.ndarray):
            latency[column] = np.concatenate([values, np.asarray(added, dtype=values.dtype)])
        else:
            latency[column] = list(values) + list(
                np.asarray(added).tolist() if isinstance(added, np.ndarray) else added
            )


def _token_times(
    start: np.ndarray,
    end: np.ndarray,
    tokens_out: np.ndarray,
    starts: np.ndarray,
    batch_of: np.ndarray,
    generated: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """First/last token stamps as a static batch decodes: prefill takes the first 15% of the
    batch's compute, then every member gains a token per step until the longest is done.

    Derived from the rows, not drawn, so adding these columns left the other seeded values as they were."""
    longest = np.maximum.reduceat(tokens_out, starts)[batch_of]
    start, end = start[batch_of], end[batch_of]
    first = start + np.ceil((end - start) * 0.15).astype(np.int64)
    step = (end - first) / np.maximum(longest - 1, 1)
    last = first + np.floor(step * np.maximum(tokens_out - 1, 0)).astype(np.int64)
    return np.where(generated, first, 0), np.where(generated, last, 0)


def generate(
    rows: int,
    *,
    seed: int = 7,
    models: Sequence[str] = DEFAULT_MODELS,
    start_ms: int | None = None,
    duration_ms: int = 3_600_000,
    fleet: FleetSeed = FleetSeed(),
) -> Iterator[SeedChunk]:
    """Yield chunks of at most ~CHUNK_ROWS rows; models share the rows 60/40 (then evenly).
    `rows` counts the requests that ran: `fleet.refused_share` adds refusals on top.

    `start_ms` None: the range ends at the current minute (rows older than the
    table TTL would be dropped by ClickHouse on insert, so fixed old dates are a trap).
    """
    if start_ms is None:
        start_ms = recent_start_ms(duration_ms)
    if rows < 1 or duration_ms < 1000:
        raise ValueError("rows must be >= 1 and duration_ms >= 1000")
    shares = [0.6, 0.4] if len(models) == 2 else [1 / len(models)] * len(models)
    per_model = [int(rows * s) for s in shares]
    per_model[0] += rows - sum(per_model)
    for index, (name, model_rows) in enumerate(zip(models, per_model, strict=True)):
        if model_rows == 0:
            continue
        shape = SHAPES[index % len(SHAPES)]
        slices = max(1, -(-model_rows // CHUNK_ROWS))
        slice_ms = duration_ms // slices
        done, first_batch = 0, 1
        for part in range(slices):
            part_rows = model_rows // slices + (1 if part < model_rows % slices else 0)
            rng = np.random.default_rng([seed, index, part])
            span = slice_ms if part < slices - 1 else duration_ms - slice_ms * part
            chunk = _model_chunk(
                name,
                shape,
                part_rows,
                start_ms + part * slice_ms,
                span,
                start_ms,
                duration_ms,
                first_batch,
                done,
                seed,
                rng,
                fleet,
            )
            done += part_rows
            first_batch = int(chunk.batches["batch_id"].max()) + 1
            yield chunk


def insert_chunk(client: Client, database: str, chunk: SeedChunk) -> None:
    client.insert(f"{database}.request_latency", [chunk.latency[c] for c in LATENCY_COLUMNS],
                  column_names=LATENCY_COLUMNS, column_oriented=True)  # fmt: skip
    client.insert(f"{database}.batches", [chunk.batches[c] for c in BATCH_COLUMNS],
                  column_names=BATCH_COLUMNS, column_oriented=True)  # fmt: skip


def seed_database(client: Client, database: str, rows: int, **options: Any) -> SeedSummary:
    """Generate and insert `rows` latency rows (and their batches) straight into the raw tables."""
    batches = 0
    low, high = None, None
    models = tuple(options.get("models", DEFAULT_MODELS))
    for chunk in generate(rows, **options):
        insert_chunk(client, database, chunk)
        batches += len(chunk.batches["batch_id"])
        enqueue = chunk.latency["enqueue_time"]
        low = min(enqueue) if low is None else min(low, min(enqueue))
        high = max(chunk.latency["produce_time"]) if high is None else max(high, max(chunk.latency["produce_time"]))
    assert low is not None and high is not None
    return SeedSummary(rows=rows, batches=batches, models=models, time_from_ms=int(low), time_to_ms=int(high))


def _value(column: Any, i: int) -> Any:
    value = column[i]
    return value.item() if isinstance(value, np.generic) else value


def latency_events(chunk: SeedChunk) -> list[LatencyEvent]:
    """The chunk's latency rows as wire events (what a consumer would have produced)."""
    c = chunk.latency
    return [
        LatencyEvent(
            request_id=c["request_id"][i], model=c["model"][i], consumer_id=c["consumer_id"][i],
            outcome=c["outcome"][i], enqueue_ms=c["enqueue_time"][i], fetch_ms=c["fetch_time"][i],
            dispatch_ms=c["dispatch_time"][i], compute_start_ms=c["compute_start_time"][i],
            compute_end_ms=c["compute_end_time"][i], produce_ms=c["produce_time"][i],
            wait_ms=_value(c["wait_ms"], i), compute_ms=_value(c["compute_ms"], i), e2e_ms=_value(c["e2e_ms"], i),
            batch_id=_value(c["batch_id"], i), batch_size=_value(c["batch_size"], i),
            tail_marked=_value(c["tail_marked"], i), priority=_value(c["priority"], i),
            tokens_in=_value(c["tokens_in"], i), tokens_out=_value(c["tokens_out"], i),
            device_mem_bytes=_value(c["device_mem_bytes"], i), device_mem_kind=c["device_mem_kind"][i],
            partition=_value(c["kafka_partition"], i), offset=_value(c["kafka_offset"], i),
            forwarded=_value(c["forwarded"], i), warmup=_value(c["warmup"], i),
            first_token_ms=c["first_token_time"][i], last_token_ms=c["last_token_time"][i],
            reason=c["reason"][i], trace_index=_value(c["trace_index"], i),
        )
        for i in range(chunk.rows)
    ]  # fmt: skip


def batch_events(chunk: SeedChunk) -> list[BatchEvent]:
    """The chunk's batch rows as wire events."""
    c = chunk.batches
    return [
        BatchEvent(
            batch_id=_value(c["batch_id"], i), model=c["model"][i], consumer_id=c["consumer_id"][i],
            dispatch_ms=c["dispatch_time"][i], size=_value(c["size"], i), cost=_value(c["cost"], i),
            reason=c["reason"][i], window_ms=_value(c["window_ms"], i), hit_target=_value(c["hit_target"], i),
            target_size=_value(c["target_size"], i), marked_count=_value(c["marked_count"], i),
            oldest_wait_ms=_value(c["oldest_wait_ms"], i), queue_depth=_value(c["queue_depth"], i),
            effective_cap=_value(c["effective_cap"], i), cap_reason=c["cap_reason"][i],
            arrival_rate_per_s=_value(c["arrival_rate_per_s"], i), compute_ms=_value(c["compute_ms"], i),
            tokens_in=_value(c["tokens_in"], i), tokens_out=_value(c["tokens_out"], i),
            device_mem_bytes=_value(c["device_mem_bytes"], i), device_mem_kind=c["device_mem_kind"][i],
        )
        for i in range(len(c["batch_id"]))
    ]  # fmt: skip
