"""consumer_lag in the real engine (chDB): rows from lag events, replays dropped, and the
lag queries (report, board, Grafana) summing partitions the way Burrow does."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from clickhouse_connect.driver.client import Client
from rich.console import Console

from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.connection import connect
from pipeline.core.store.lag_writer import insert_lag_events
from pipeline.tools.views.report import render, run_query, run_report
from schemas.messages import LagEvent, PartitionLag

T0 = (int(time.time()) // 60 - 10) * 60_000
"""A minute boundary ten minutes ago (rows older than the TTL would be dropped); ranges are explicit."""


def lag_event(
    consumer: str,
    ts_ms: int,
    lags: dict[int, int],
    *,
    model: str = "m",
    age_ms: float = 0.0,
    batches: int = 0,
    dead_letters: int = 0,
    last_batch_ms: int = 0,
    window_ms: float = 4.0,
) -> LagEvent:
    parts = [
        PartitionLag(f"p.requests.{model}", p, 100 + lag, 100 if lag else 100 + lag, lag,
                     int(ts_ms - age_ms) if lag else 0, age_ms if lag else 0.0)
        for p, lag in sorted(lags.items())
    ]  # fmt: skip
    return LagEvent(
        ts_ms=ts_ms, model=model, consumer_id=consumer, group=f"p.consumers.{model}", partitions=parts,
        queue=7, inflight=1, window_ms=window_ms, effective_cap=32, cap_reason="knee", marked_share=0.01,
        arrival_rate_per_s=50.0, batches=batches, last_batch_ms=last_batch_ms, dead_letters=dead_letters,
    )  # fmt: skip


def _rows(client: Client, db: str, sql: str) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in client.query(sql.replace("{db}", db)).result_rows]


def test_events_become_one_row_per_partition_and_replays_are_dropped(
    clickhouse_client: Client, ch_database: str
) -> None:
    events = [
        lag_event("c1", T0, {0: 5, 1: 0}, age_ms=1500.0),
        lag_event("c2", T0 + 10, {2: 3}, age_ms=800.0),
        lag_event("idle", T0 + 20, {}),
    ]
    assert insert_lag_events(clickhouse_client, ch_database, events) == 3
    assert insert_lag_events(clickhouse_client, ch_database, events + events[:1]) == 0, "replays are not stored twice"
    rows = _rows(clickhouse_client, ch_database,
                 "SELECT consumer_id, partition, lag, lag_age_ms, toUnixTimestamp64Milli(oldest_time) "
                 "FROM {db}.consumer_lag ORDER BY consumer_id, partition")  # fmt: skip
    assert rows == [
        ("c1", 0, 5, 1500.0, T0 - 1500),
        ("c1", 1, 0, 0.0, 0),
        ("c2", 2, 3, 800.0, T0 + 10 - 800),
        ("idle", -1, 0, 0.0, 0),
    ]


def test_lag_queries_sum_the_latest_sample_of_each_partition(
    clickhouse_client: Client, clickhouse_settings: ClickHouseSettings, ch_database: str
) -> None:
    # Two consumers own two partitions each; c1 samples twice in the bucket (the later one counts),
    # and partition 1 moves to c2 late in the bucket (its latest sample, from c2, counts once).
    events = [
        lag_event("c1", T0 + 1_000, {0: 50, 1: 40}, age_ms=4_000.0),
        lag_event("c1", T0 + 6_000, {0: 10, 1: 30}, age_ms=2_000.0),
        lag_event("c2", T0 + 7_000, {1: 20, 2: 5, 3: 0}, age_ms=9_000.0),
        lag_event("c1", T0 + 61_000, {0: 0}, age_ms=0.0),
        lag_event("c2", T0 + 62_000, {1: 0, 2: 1, 3: 0}, age_ms=300.0),
    ]
    insert_lag_events(clickhouse_client, ch_database, events)
    client = _client_on(clickhouse_settings, ch_database)
    span: dict[str, Any] = {"time_from_ms": T0, "time_to_ms": T0 + 120_000, "interval_ms": 60_000, "model": "m"}
    over_time = run_query(client, "lag_over_time", **span)
    assert [(r["lag"], r["lag_age_ms"]) for r in over_time] == [(10 + 20 + 5 + 0, 9_000.0), (1, 300.0)]
    (summary,) = run_query(client, "lag_summary", **span)
    assert (summary["lag_now"], summary["lag_age_now_ms"], summary["lag_max"], summary["lag_age_max_ms"]) == (
        1,
        300.0,
        35,
        9_000.0,
    )
    assert summary["consumers"] == 2
    assert run_query(client, "lag_over_time", **{**span, "model": "other"}) == []
    state = run_query(client, "engine_state", **span)
    assert [round(r["window_ms"], 3) for r in state] == [4.0, 4.0] and all(r["effective_cap"] == 32 for r in state)


def test_report_prints_the_lag_section(
    clickhouse_client: Client, clickhouse_settings: ClickHouseSettings, ch_database: str
) -> None:
    from pipeline.core.store.seed import generate, insert_chunk

    for chunk in generate(200, seed=5, start_ms=T0, duration_ms=60_000):
        insert_chunk(clickhouse_client, ch_database, chunk)
    models = [r[0] for r in _rows(clickhouse_client, ch_database, "SELECT DISTINCT model FROM {db}.request_latency")]
    insert_lag_events(clickhouse_client, ch_database, [
        lag_event("c1", T0 + 30_000, {0: 42}, model=models[0], age_ms=12_345.0),
    ])  # fmt: skip
    client = _client_on(clickhouse_settings, ch_database)
    report = run_report(client, time_from_ms=T0, time_to_ms=T0 + 60_000)
    assert report.sections["lag_summary"][0]["lag_now"] == 42
    console = Console(width=200, record=True)
    render(report, console)
    text = console.export_text()
    assert "Consumer lag" in text and "12.3 s" in text and "42" in text


def _client_on(settings: ClickHouseSettings, database: str) -> Client:
    """A client whose default database is `database`, as `report` opens it."""
    return connect(dataclasses.replace(settings, database=database), database=database)


def test_report_without_answers_still_shows_the_lag(
    clickhouse_client: Client, clickhouse_settings: ClickHouseSettings, ch_database: str
) -> None:
    """Consumers that answer nothing while records pile up: exactly when the lag matters."""
    insert_lag_events(clickhouse_client, ch_database, [lag_event("stuck", T0 + 5_000, {0: 900}, age_ms=240_000.0)])
    report = run_report(_client_on(clickhouse_settings, ch_database), time_from_ms=T0, time_to_ms=T0 + 60_000)
    console = Console(width=200, record=True)
    render(report, console)
    text = console.export_text()
    assert "no latency rows" in text and "Consumer lag" in text and "900" in text and "240.0 s" in text
