"""Events to rows: decode, drop what is already stored, insert one block per table.

Re-delivered events (at-least-once Kafka, a sink restarted before its offsets
were committed, a consumer that re-ran a request) must not count twice. The
raw tables are ReplacingMergeTree, which collapses duplicates only when parts
merge, and the per-minute rollups are fed by materialized views that see every
inserted block. So duplicates are dropped *before* the insert: within the
batch, and against the table by primary-key lookup (model, time range, id).
That keeps raw counts and rollups exact for any replay handled by one sink at
a time; ReplacingMergeTree (and FINAL in exact queries) is the safety net for
two sinks racing on the same ids during a group rebalance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from clickhouse_connect.driver.client import Client

from schemas.messages import BatchEvent, LatencyEvent, batch_event_id

LATENCY_COLUMNS = (
    "request_id", "model", "consumer_id", "outcome",
    "enqueue_time", "fetch_time", "dispatch_time", "compute_start_time", "compute_end_time", "produce_time",
    "wait_ms", "compute_ms", "e2e_ms", "batch_id", "batch_size", "tail_marked", "priority",
    "tokens_in", "tokens_out", "device_mem_bytes", "device_mem_kind",
    "kafka_partition", "kafka_offset", "forwarded", "schema_version", "warmup",
    "first_token_time", "last_token_time", "reason", "trace_index",
)  # fmt: skip

BATCH_COLUMNS = (
    "batch_id", "model", "consumer_id", "dispatch_time", "size", "cost", "reason", "window_ms",
    "hit_target", "target_size", "marked_count", "oldest_wait_ms", "queue_depth", "effective_cap",
    "cap_reason", "arrival_rate_per_s", "compute_ms", "tokens_in", "tokens_out",
    "device_mem_bytes", "device_mem_kind", "schema_version",
)  # fmt: skip

ID_LOOKUP_CHUNK = 2000
"""Ids per existence query: keeps the bound array (an HTTP parameter) well under URL limits."""


NO_BATCH_ID = 0
"""How `request_latency.batch_id` (UInt64) stores a request that ran in no batch (an event's batch_id -1:
expired in the queue, refused): engine batch ids start at 1, so 0 is free. Inserting -1 would fail the
whole block, and the sink would retry that block forever."""


def latency_row(e: LatencyEvent) -> list[Any]:
    return [
        e.request_id, e.model, e.consumer_id, e.outcome,
        e.enqueue_ms, e.fetch_ms, e.dispatch_ms, e.compute_start_ms, e.compute_end_ms, e.produce_ms,
        e.wait_ms, e.compute_ms, e.e2e_ms, e.batch_id if e.batch_id >= 0 else NO_BATCH_ID, e.batch_size,
        e.tail_marked, e.priority,
        e.tokens_in, e.tokens_out, e.device_mem_bytes, e.device_mem_kind,
        e.partition, e.offset, e.forwarded, e.v, e.warmup,
        e.first_token_ms, e.last_token_ms, e.reason, e.trace_index,
    ]  # fmt: skip


def batch_row(e: BatchEvent) -> list[Any]:
    return [
        e.batch_id, e.model, e.consumer_id, e.dispatch_ms, e.size, e.cost, e.reason, e.window_ms,
        e.hit_target, e.target_size, e.marked_count, e.oldest_wait_ms, e.queue_depth, e.effective_cap,
        e.cap_reason, e.arrival_rate_per_s, e.compute_ms, e.tokens_in, e.tokens_out,
        e.device_mem_bytes, e.device_mem_kind, e.v,
    ]  # fmt: skip


def _first_of_each(events: Iterable[Any], key: Any) -> dict[str, Any]:
    unique: dict[str, Any] = {}
    for event in events:
        unique.setdefault(key(event), event)
    return unique


def _stored_ids(
    client: Client, table: str, id_expr: str, time_col: str, events: Sequence[Any], ids: list[str], time_of: Any
) -> set[str]:
    """Which of `ids` the table already holds, looked up through its sorting key."""
    models = sorted({e.model for e in events})
    times = [time_of(e) for e in events]
    found: set[str] = set()
    for start in range(0, len(ids), ID_LOOKUP_CHUNK):
        rows = client.query(
            f"SELECT {id_expr} FROM {table} "
            f"WHERE model IN (SELECT arrayJoin({{models:Array(String)}})) "
            f"AND {time_col} BETWEEN fromUnixTimestamp64Milli({{lo:Int64}}, 'UTC') "
            f"AND fromUnixTimestamp64Milli({{hi:Int64}}, 'UTC') "
            f"AND {id_expr} IN (SELECT arrayJoin({{ids:Array(String)}}))",
            parameters={
                "models": models,
                "lo": min(times),
                "hi": max(times),
                "ids": ids[start : start + ID_LOOKUP_CHUNK],
            },
        ).result_rows
        found.update(str(r[0]) for r in rows)
    return found


def insert_latency_events(client: Client, database: str, events: Sequence[LatencyEvent]) -> int:
    """Insert the events whose request id is not stored yet; returns rows inserted."""
    if not events:
        return 0
    unique = _first_of_each(events, lambda e: e.request_id)
    table = f"{database}.request_latency"
    stored = _stored_ids(client, table, "request_id", "enqueue_time", events, list(unique), lambda e: e.enqueue_ms)
    rows = [latency_row(e) for rid, e in unique.items() if rid not in stored]
    if rows:
        client.insert(table, rows, column_names=LATENCY_COLUMNS)
    return len(rows)


def insert_batch_events(client: Client, database: str, events: Sequence[BatchEvent]) -> int:
    """Insert the batches whose (consumer_id, batch_id) is not stored yet; returns rows inserted."""
    if not events:
        return 0
    unique = _first_of_each(events, lambda e: batch_event_id(e.consumer_id, e.batch_id))
    table = f"{database}.batches"
    key_expr = "concat(consumer_id, ':', toString(batch_id))"
    stored = _stored_ids(client, table, key_expr, "dispatch_time", events, list(unique), lambda e: e.dispatch_ms)
    rows = [batch_row(e) for key, e in unique.items() if key not in stored]
    if rows:
        client.insert(table, rows, column_names=BATCH_COLUMNS)
    return len(rows)
