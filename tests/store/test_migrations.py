"""Schema migrations on the real engine, and the cluster DDL text."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from clickhouse_connect.driver.client import Client

from pipeline.core.store.migrations import SCHEMA_DIR, Layout, MigrationError, load_migrations, migrate, render_all
from pipeline.core.store.queries import QUERIES

RAW_AND_ROLLUP_TABLES = {"request_latency", "batches", "latency_minute", "batches_minute", "schema_migrations"}


def test_migrate_twice_records_every_version_once(clickhouse_client: Client, ch_database: str) -> None:
    versions = [m.version for m in load_migrations()]
    second = migrate(clickhouse_client, Layout(ch_database))
    assert second.applied == [] and second.already == versions
    recorded = clickhouse_client.query(
        f"SELECT version, count() FROM {ch_database}.schema_migrations GROUP BY version ORDER BY version"
    ).result_rows
    assert recorded == [(v, 1) for v in versions]
    rows = clickhouse_client.query(
        "SELECT name, engine FROM system.tables WHERE database = {db:String}", parameters={"db": ch_database}
    ).result_rows
    tables = {row[0]: row[1] for row in rows}
    assert tables["request_latency"] == "ReplacingMergeTree"
    assert tables["batches"] == "ReplacingMergeTree"
    assert tables["latency_minute"] == "AggregatingMergeTree"
    assert tables["latency_minute_mv"] == "MaterializedView"


def test_columns_have_the_promised_types(clickhouse_client: Client, ch_database: str) -> None:
    rows = clickhouse_client.query(
        "SELECT name, type FROM system.columns WHERE database = {db:String} AND table = 'request_latency'",
        parameters={"db": ch_database},
    ).result_rows
    types = {row[0]: row[1] for row in rows}
    assert types["enqueue_time"] == "DateTime64(3, 'UTC')"
    for name in ("model", "consumer_id", "outcome", "device_mem_kind"):
        assert types[name] == "LowCardinality(String)"
    create = str(clickhouse_client.command(f"SHOW CREATE TABLE {ch_database}.request_latency"))
    assert "ORDER BY (model, enqueue_time, request_id)" in create
    assert "PARTITION BY toDate(enqueue_time)" in create
    assert "toIntervalDay(30)" in create


def test_ttl_follows_the_layout(clickhouse_client: Client) -> None:
    database = "t_ttl_seven"
    try:
        migrate(clickhouse_client, Layout(database, ttl_days=7, rollup_ttl_days=90))
        create = str(clickhouse_client.command(f"SHOW CREATE TABLE {database}.batches"))
        rollup = str(clickhouse_client.command(f"SHOW CREATE TABLE {database}.latency_minute"))
        assert "toIntervalDay(7)" in create and "toIntervalDay(90)" in rollup
    finally:
        clickhouse_client.command(f"DROP DATABASE IF EXISTS {database} SYNC")


def test_an_edited_applied_migration_is_refused(clickhouse_client: Client, ch_database: str, tmp_path: Path) -> None:
    edited = tmp_path / "schema"
    shutil.copytree(SCHEMA_DIR, edited)
    target = edited / "0002_batches.sql"
    target.write_text(target.read_text().replace("queue_depth        UInt32", "queue_depth        UInt64"))
    with pytest.raises(MigrationError, match=re.escape("0002_batches.sql changed after it was applied")):
        migrate(clickhouse_client, Layout(ch_database), edited)


def _statements(sql: str) -> list[str]:
    body = "\n".join(line for line in sql.splitlines() if not line.startswith("--"))
    return [s.strip() for s in body.split(";") if s.strip()]


def test_cluster_ddl_text() -> None:
    statements = _statements(render_all(Layout("batchtide", cluster="prod")))
    assert statements and all("ON CLUSTER 'prod'" in s for s in statements)
    engines = re.findall(r"ENGINE = (\w+)", "\n".join(statements))
    assert "ReplacingMergeTree" not in engines and "AggregatingMergeTree" not in engines
    assert "ReplicatedReplacingMergeTree" in engines and "ReplicatedAggregatingMergeTree" in engines
    assert all("'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'" in s
               for s in statements if "ENGINE = Replicated" in s)  # fmt: skip
    for table in RAW_AND_ROLLUP_TABLES:
        local = [s for s in statements if s.startswith(f"CREATE TABLE IF NOT EXISTS batchtide.{table}_local ")]
        dist = [s for s in statements if s.startswith(f"CREATE TABLE IF NOT EXISTS batchtide.{table} ON CLUSTER")]
        assert len(local) == 1 and "ENGINE = Replicated" in local[0], table
        assert len(dist) == 1, table
        assert f"ENGINE = Distributed('prod', 'batchtide', '{table}_local'," in dist[0]
    mvs = [s for s in statements if s.startswith("CREATE MATERIALIZED VIEW")]
    assert len(mvs) == 2 and all("_local" in mv.split(" AS SELECT")[0] and "FROM batchtide." in mv for mv in mvs)
    assert all(re.search(r"FROM batchtide\.\w+_local", mv) for mv in mvs), "MVs must read the shard-local table"


def test_same_schema_single_node_has_no_cluster_parts() -> None:
    text = render_all(Layout("batchtide"))
    for marker in ("ON CLUSTER", "Replicated", "Distributed", "_local", "${"):
        assert marker not in text


def test_analysis_sql_names_only_tables_both_layouts_define() -> None:
    single = render_all(Layout("batchtide"))
    cluster = render_all(Layout("batchtide", cluster="prod"))
    named = [
        (query.name, table) for query in QUERIES.values() for table in re.findall(r"\bFROM\s+([a-z_]+)", query.sql)
    ]
    assert named, "no analysis query names a table: nothing would be checked"
    for name, table in named:
        assert f"batchtide.{table}\n" in single or f"batchtide.{table} " in single, (name, table)
        assert f"CREATE TABLE IF NOT EXISTS batchtide.{table} ON CLUSTER 'prod' AS" in cluster, (name, table)


def test_bad_names_never_reach_ddl() -> None:
    with pytest.raises(ValueError):
        Layout("batchtide; DROP TABLE x")
    with pytest.raises(ValueError):
        Layout("batchtide", cluster="c' OR 1")
