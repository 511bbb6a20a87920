"""Replaying the same events leaves counts, quantiles and rollups unchanged."""

from __future__ import annotations

from typing import Any

import msgspec
from clickhouse_connect.driver.client import Client

from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.connection import connect
from pipeline.core.store.seed import batch_events, generate, insert_chunk, latency_events, recent_start_ms
from pipeline.core.store.writer import insert_batch_events, insert_latency_events
from pipeline.tools.views.report import run_query

DURATION_MS = 120_000


def _figures(settings: ClickHouseSettings, database: str, start_ms: int) -> dict[str, Any]:
    client = connect(settings, database=database)
    window: dict[str, Any] = {
        "time_from_ms": start_ms - 120_000,
        "time_to_ms": start_ms + DURATION_MS + 60_000,
        "interval_ms": 60_000,
        "model": None,
    }
    figures: dict[str, Any] = {
        "raw": client.command(f"SELECT count() FROM {database}.request_latency"),
        "raw_batches": client.command(f"SELECT count() FROM {database}.batches"),
        "rollup": client.command(f"SELECT sum(requests) FROM {database}.latency_minute"),
        "rollup_batches": client.command(f"SELECT sum(batches) FROM {database}.batches_minute"),
        "summary": run_query(client, "summary", **window),
        "sizes": run_query(client, "batch_sizes", **window),
    }
    client.close()
    return figures


def test_replaying_events_through_the_writer_changes_nothing(
    clickhouse_client: Client, clickhouse_settings: ClickHouseSettings, ch_database: str
) -> None:
    start = recent_start_ms(DURATION_MS)
    chunks = list(generate(6_000, seed=4, start_ms=start, duration_ms=DURATION_MS))
    latency = [e for c in chunks for e in latency_events(c)]
    batches = [b for c in chunks for b in batch_events(c)]
    assert insert_latency_events(clickhouse_client, ch_database, latency) == len(latency)
    assert insert_batch_events(clickhouse_client, ch_database, batches) == len(batches)
    once = _figures(clickhouse_settings, ch_database, start)
    assert once["raw"] == once["rollup"] == len(latency) and once["raw_batches"] == len(batches)

    assert insert_latency_events(clickhouse_client, ch_database, latency) == 0
    assert insert_batch_events(clickhouse_client, ch_database, batches) == 0
    overlapping = latency[len(latency) // 2 :] + latency[:10]  # a replay straddling stored and new
    assert insert_latency_events(clickhouse_client, ch_database, overlapping + overlapping) == 0
    rerun = msgspec.structs.replace(latency[0], produce_ms=latency[0].produce_ms + 500, e2e_ms=latency[0].e2e_ms + 500)
    assert insert_latency_events(clickhouse_client, ch_database, [rerun]) == 0, (
        "a re-run request keeps its first answer"
    )
    assert _figures(clickhouse_settings, ch_database, start) == once


def test_duplicates_slipping_past_the_writer_are_collapsed_by_final(
    clickhouse_client: Client, clickhouse_settings: ClickHouseSettings, ch_database: str
) -> None:
    """Two sinks racing on the same ids insert twice; exact queries read FINAL and stay right."""
    start = recent_start_ms(DURATION_MS)
    (chunk,) = generate(3_000, seed=9, models=("minilm",), start_ms=start, duration_ms=DURATION_MS)
    insert_chunk(clickhouse_client, ch_database, chunk)
    once = _figures(clickhouse_settings, ch_database, start)
    insert_chunk(clickhouse_client, ch_database, chunk)
    twice = _figures(clickhouse_settings, ch_database, start)
    assert twice["raw"] == 2 * once["raw"], "raw parts hold both copies until a merge"
    assert twice["summary"] == once["summary"] and twice["sizes"] == once["sizes"]
    assert twice["rollup"] == 2 * once["rollup"], "documented: rollups count what was inserted"
