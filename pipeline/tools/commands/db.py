"""CLI commands: `db migrate|seed|bench-sink|bench-report`, `sink` and `report` (ClickHouse side)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from pipeline.core.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from clickhouse_connect.driver.client import Client

    from pipeline.core.store.migrations import Layout

db_app = typer.Typer(help="ClickHouse latency store: schema migrations, seed data, benchmarks.", no_args_is_help=True)

ConfigOption = typer.Option(None, "--config", help="batchtide TOML config file.")
UrlOption = typer.Option(
    None,
    "--clickhouse-url",
    help="ClickHouse HTTP(S) URL (default: config / BATCHTIDE_CLICKHOUSE_URL; empty: embedded chDB).",
)


def _config(path: Path | None, clickhouse_url: str | None) -> Config:
    try:
        config = load_config(path)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if clickhouse_url is not None:
        config = dataclasses.replace(config, clickhouse=dataclasses.replace(config.clickhouse, url=clickhouse_url))
    return config


def _connect(config: Config, database: str | None = None, *, reading: bool = False) -> Client:
    """A ClickHouse client; `reading` ones use a running sink's read-only server when it holds the embedded store."""
    from pipeline.core.store.connection import ClickHouseUnavailable, connect, connect_reader

    try:
        return (connect_reader if reading else connect)(config.clickhouse, database=database)
    except ClickHouseUnavailable as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


def _layout(config: Config, cluster: str | None) -> Layout:
    from pipeline.core.store.migrations import Layout

    ch = config.clickhouse
    try:
        return Layout(ch.database, ttl_days=ch.ttl_days, rollup_ttl_days=ch.rollup_ttl_days, cluster=cluster)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@db_app.command("migrate")
def migrate_command(
    cluster: str | None = typer.Option(
        None, "--cluster", help="Emit the cluster layout: ON CLUSTER, Replicated* engines, Distributed tables."
    ),
    print_only: bool = typer.Option(False, "--print", help="Print the rendered SQL instead of running it."),
    config: Path | None = ConfigOption,
    clickhouse_url: str | None = UrlOption,
) -> None:
    """Create or upgrade the schema (idempotent; applied files are recorded in schema_migrations)."""
    from pipeline.core.store.migrations import MigrationError, migrate, render_all

    cfg = _config(config, clickhouse_url)
    layout = _layout(cfg, cluster)
    if print_only:
        typer.echo(render_all(layout), nl=False)
        return
    client = _connect(cfg)
    try:
        result = migrate(client, layout)
    except MigrationError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        client.close()
    applied = ", ".join(f"{v:04d}" for v in result.applied) or "none"
    typer.echo(f"database {layout.database}: applied {applied}; {len(result.already)} already applied")


@db_app.command("seed")
def seed_command(
    rows: int = typer.Option(100_000, "--rows", min=1, help="Latency rows to generate (batches follow)."),
    seed: int = typer.Option(7, "--seed", help="Random seed: the same seed gives the same rows."),
    duration: str = typer.Option("1h", "--duration", help="Time range covered, ending now (e.g. 15m, 1h, 1d)."),
    slow_consumer: float = typer.Option(
        1.0,
        "--slow-consumer",
        min=1.0,
        help="Each model's second consumer is this many times slower (compute and waits).",
    ),
    refused: float = typer.Option(0.0, "--refused", min=0.0, max=1.0, help="Add this share of refused requests."),
    config: Path | None = ConfigOption,
    clickhouse_url: str | None = UrlOption,
) -> None:
    """Insert deterministic synthetic latency and batch rows (for boards, demos and benchmarks)."""
    from pipeline.core.store.migrations import migrate
    from pipeline.core.store.seed import FleetSeed, seed_database
    from pipeline.tools.views.report import parse_duration_ms

    cfg = _config(config, clickhouse_url)
    client = _connect(cfg)
    try:
        migrate(client, _layout(cfg, None))
        started = time.perf_counter()
        summary = seed_database(
            client,
            cfg.clickhouse.database,
            rows,
            seed=seed,
            duration_ms=parse_duration_ms(duration),
            fleet=FleetSeed(slow_factor=slow_consumer, refused_share=refused),
        )
        elapsed = time.perf_counter() - started
    finally:
        client.close()
    typer.echo(
        f"seeded {summary.rows:,} requests in {summary.batches:,} batches for {', '.join(summary.models)} "
        f"into {cfg.clickhouse.database} in {elapsed:.1f} s ({summary.rows / elapsed:,.0f} rows/s)"
    )


@db_app.command("bench-report")
def bench_report_command(
    rows: int = typer.Option(10_000_000, "--rows", min=1, help="Seed this many rows first if the database has fewer."),
    repeat: int = typer.Option(10, "--repeat", min=1, help="Runs of each report query."),
    since: str = typer.Option("1h", "--since", help="Report range (the seeded range ends now)."),
    config: Path | None = ConfigOption,
    clickhouse_url: str | None = UrlOption,
) -> None:
    """Time every report query (p50/p99/max over --repeat runs) on a seeded database."""
    from pipeline.tools.bench.store import bench_report

    cfg = _config(config, clickhouse_url)
    bench_report(cfg.clickhouse, rows=rows, repeat=repeat, since=since, echo=typer.echo)


@db_app.command("bench-sink")
def bench_sink_command(
    events: int = typer.Option(200_000, "--events", min=1, help="Latency events to produce (batch events follow)."),
    config: Path | None = ConfigOption,
    clickhouse_url: str | None = UrlOption,
) -> None:
    """Produce seeded events to fresh topics, run the faust sink until all are stored, print events/s."""
    import asyncio

    from pipeline.tools.bench.store import bench_sink

    cfg = _config(config, clickhouse_url)
    asyncio.run(bench_sink(cfg, events=events, echo=typer.echo))


def sink_command(
    config: Path | None = ConfigOption,
    clickhouse_url: str | None = UrlOption,
    log_level: str = typer.Option("info", "--log-level", help="crit, error, warn, info or debug."),
) -> None:
    """Run the sink: events topics -> ClickHouse in batches; offsets advance only after inserts."""
    import asyncio

    import faust

    from pipeline.core.store.connection import describe
    from pipeline.core.store.live import publish
    from pipeline.sink.app import build_sink, wait_until_ready

    cfg = _config(config, clickhouse_url)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pipeline.core.kafka.client import resolve_replication

    asyncio.run(wait_until_ready(cfg, _layout(cfg, None)))
    cfg = dataclasses.replace(cfg, kafka=asyncio.run(resolve_replication(cfg.kafka)))
    sink = build_sink(cfg)
    typer.echo(f"sink: {sink.topics.latency_events}, {sink.topics.batch_events} -> {describe(cfg.clickhouse)}")
    live = publish(cfg.clickhouse)
    if live is not None:
        typer.echo(f"sink: read-only ClickHouse HTTP interface on {live.server.url} (user {cfg.clickhouse.http_user})")
    sys.argv = sys.argv[:1]
    try:
        faust.Worker(sink.app, loglevel=log_level).execute_from_commandline()
    finally:
        if live is not None:
            live.close()
        sink.store.close()


def report_command(
    model: str | None = typer.Option(None, "--model", help="Only this model (bound as a query parameter)."),
    since: str = typer.Option("15m", "--since", help="Range ending now: 30s, 15m, 2h, 1d..."),
    interval: str | None = typer.Option(None, "--interval", help="Bucket size (default: about 12 buckets)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (for scripts) instead of tables."),
    config: Path | None = ConfigOption,
    clickhouse_url: str | None = UrlOption,
) -> None:
    """Latency analysis per model: quantiles, throughput, batches, tail marking, memory."""
    from rich.console import Console

    from pipeline.tools.views.report import Objective, parse_duration_ms, render, run_report

    cfg = _config(config, clickhouse_url)
    try:
        span = parse_duration_ms(since)
        bucket = parse_duration_ms(interval) if interval else None
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    client = _connect(cfg, cfg.clickhouse.database, reading=True)
    try:
        now = int(time.time() * 1000)
        objectives = {
            m.name: Objective(m.profile.slo_p99_ms, m.profile.slo_ms_per_new_token) for m in cfg.models.values()
        }
        report = run_report(
            client, time_from_ms=now - span, time_to_ms=now, model=model, interval_ms=bucket, objectives=objectives
        )
    finally:
        client.close()
    if as_json:
        typer.echo(report.to_json())
    else:
        render(report, Console())


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.add_typer(db_app, name="db")
    app.command("sink")(sink_command)
    app.command("report")(report_command)
