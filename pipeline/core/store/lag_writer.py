"""Lag samples to `consumer_lag` rows: one row per partition of each sample.

Two sources write the table. A consumer's own `LagEvent` (source
'consumer') is identified by (consumer_id, ts_ms); a replayed event (a sink
restarted before its commit) is dropped when that pair is already stored,
as the latency and batch writers do for their ids. The sink's broker-side
`GroupSample` (source 'broker', consumer_id '', the group's member count) is
taken by the sink itself and never replayed, so it is inserted as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clickhouse_connect.driver.client import Client

from pipeline.core.store.group_lag import GroupSample
from schemas.messages import SCHEMA_VERSION, LagEvent, PartitionLag

LAG_COLUMNS = (
    "ts", "model", "consumer_id", "topic", "partition", "end_offset", "committed_offset", "lag",
    "oldest_time", "lag_age_ms", "queue", "inflight", "window_ms", "effective_cap", "cap_reason",
    "marked_share", "arrival_rate_per_s", "batches", "last_batch_time", "dead_letters", "schema_version",
    "capacity_per_s", "source", "members",
)  # fmt: skip

NO_PARTITION = PartitionLag(
    topic="", partition=-1, end_offset=0, committed_offset=-1, lag=0, oldest_ms=0, lag_age_ms=0.0
)
"""The row of a consumer that holds no partition: its state and counters still count."""


def sample_key(e: LagEvent) -> str:
    return f"{e.consumer_id}:{e.ts_ms}"


def lag_rows(e: LagEvent) -> list[list[Any]]:
    return [
        [
            e.ts_ms,
            e.model,
            e.consumer_id,
            p.topic,
            p.partition,
            p.end_offset,
            p.committed_offset,
            p.lag,
            p.oldest_ms,
            p.lag_age_ms,
            e.queue,
            e.inflight,
            e.window_ms,
            e.effective_cap,
            e.cap_reason,
            e.marked_share,
            e.arrival_rate_per_s,
            e.batches,
            e.last_batch_ms,
            e.dead_letters,
            e.v,
            e.capacity_per_s,
            "consumer",
            0,
        ]
        for p in (e.partitions or [NO_PARTITION])
    ]


def group_rows(s: GroupSample) -> list[list[Any]]:
    """A broker-side sample's rows: the consumer's engine state and counters are not known here (0)."""
    return [
        [
            s.ts_ms,
            s.model,
            "",
            p.topic,
            p.partition,
            p.end_offset,
            p.committed_offset,
            p.lag,
            p.oldest_ms,
            p.lag_age_ms,
            0,
            0,
            0.0,
            0,
            "",
            0.0,
            0.0,
            0,
            0,
            0,
            SCHEMA_VERSION,
            0.0,
            "broker",
            s.members,
        ]
        for p in (s.partitions or [NO_PARTITION])
    ]


def insert_group_samples(client: Client, database: str, samples: Sequence[GroupSample]) -> int:
    """Insert the sink's broker-side samples; returns the number of samples."""
    rows = [row for s in samples for row in group_rows(s)]
    if rows:
        client.insert(f"{database}.consumer_lag", rows, column_names=LAG_COLUMNS)
    return len(samples)


def insert_lag_events(client: Client, database: str, events: Sequence[LagEvent]) -> int:
    """Insert the samples not stored yet; returns the number of samples (not rows) inserted."""
    if not events:
        return 0
    unique: dict[str, LagEvent] = {}
    for event in events:
        unique.setdefault(sample_key(event), event)
    table = f"{database}.consumer_lag"
    times = [e.ts_ms for e in unique.values()]
    stored = {
        str(r[0])
        for r in client.query(
            f"SELECT DISTINCT concat(consumer_id, ':', toString(toUnixTimestamp64Milli(ts))) FROM {table} "
            "WHERE ts BETWEEN fromUnixTimestamp64Milli({lo:Int64}, 'UTC') AND fromUnixTimestamp64Milli({hi:Int64}, 'UTC') "
            "AND consumer_id IN (SELECT arrayJoin({consumers:Array(String)}))",
            parameters={
                "lo": min(times),
                "hi": max(times),
                "consumers": sorted({e.consumer_id for e in unique.values()}),
            },
        ).result_rows
    }
    fresh = [e for key, e in unique.items() if key not in stored]
    rows = [row for e in fresh for row in lag_rows(e)]
    if rows:
        client.insert(table, rows, column_names=LAG_COLUMNS)
    return len(fresh)
