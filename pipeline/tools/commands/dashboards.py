"""CLI commands: `batchtide dashboards generate|push` (Grafana) and `batchtide board` (local HTML)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

dashboards_app = typer.Typer(
    help="Grafana dashboards as code: generate the JSON, push it to a Grafana.", no_args_is_help=True
)

ConfigOption = typer.Option(None, "--config", "-c", help="batchtide TOML config (ClickHouse settings).")


@dashboards_app.command("generate")
def generate(
    check: bool = typer.Option(
        False, "--check", help="Only verify the committed files are up to date (exit 1 if stale)."
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="Config whose models and \\[alerts] the alert rules follow (default: ./batchtide.toml of the repository).",
    ),
) -> None:
    """Regenerate dashboards/*.json (from dashboards/panels.py and the shared analysis SQL) and the
    Grafana alert rules dashboards/provisioning/alerting/batchtide.yaml (from the config)."""
    from dashboards.build import DashboardLintError, stale_files, write_all
    from pipeline.core.config import ConfigError

    if config is not None and not config.exists():
        typer.echo(f"error: config file {config} does not exist", err=True)
        raise typer.Exit(2)
    try:
        if check:
            stale = stale_files(config)
            for path in stale:
                typer.echo(f"stale: {path} (run `batchtide dashboards generate`)", err=True)
            if stale:
                raise typer.Exit(1)
            typer.echo("dashboards are up to date")
            return
        written = write_all(config)
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    except DashboardLintError as error:
        typer.echo(f"error: dashboard lint failed: {error}", err=True)
        raise typer.Exit(1) from None
    for path in written:
        typer.echo(f"wrote {path}")
    if not written:
        typer.echo("dashboards are up to date")


@dashboards_app.command("push")
def push(
    grafana_url: str = typer.Option(..., "--grafana-url", help="Grafana base URL, e.g. http://localhost:3000"),
    clickhouse_url: str | None = typer.Option(
        None,
        "--clickhouse-url",
        help="ClickHouse as Grafana reaches it: http://host:8123 or clickhouse://host:9000 "
        "(default: the config's clickhouse url, or BATCHTIDE_CLICKHOUSE_URL).",
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="batchtide TOML config: ClickHouse settings, and the models and \\[alerts] the alert rules follow "
        "(default for the rules: ./batchtide.toml of the repository, as `generate`).",
    ),
    timeout_s: float = typer.Option(10.0, "--timeout", help="HTTP timeout per Grafana call, seconds."),
) -> None:
    """Create or update the ClickHouse datasource, the folder, the boards and the alert rules (from the config's
    models and [alerts], as `generate` writes them); unchanged objects are not written.

    Auth: GRAFANA_TOKEN (service account token) or GRAFANA_USER + GRAFANA_PASSWORD.
    The datasource password is taken from BATCHTIDE_CLICKHOUSE_PASSWORD.
    """
    from grafana_client.client import GrafanaException

    from dashboards.alerts import alert_rules
    from dashboards.build import checked_board, default_config_path
    from dashboards.panels import BOARDS
    from pipeline.core.config import ConfigError, load_config
    from pipeline.tools.views.grafana_push import ClickHouseTarget, GrafanaAuthMissing, connect, push_all

    try:
        settings = load_config(config).clickhouse
        repository = default_config_path()
        # the rules follow the same config as `generate` writes them from
        rules = alert_rules(load_config(config or (repository if repository.exists() else None)))
        url = clickhouse_url or settings.url
        if not url:
            raise ConfigError(
                "Grafana cannot open the embedded ClickHouse; pass --clickhouse-url "
                "(or set BATCHTIDE_CLICKHOUSE_URL) to a ClickHouse server Grafana can reach, or to the "
                "running sink's read-only HTTP interface (<data_dir>/batchtide-live.json)"
            )
        target = ClickHouseTarget.from_url(url, settings.database)
        api = connect(grafana_url, timeout_s)
        results = push_all(api, target, [checked_board(board) for board in BOARDS], rules)
    except (ConfigError, ValueError, GrafanaAuthMissing) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    except GrafanaException as error:
        typer.echo(f"error: Grafana answered {error.status_code}: {error.message}", err=True)
        raise typer.Exit(1) from None
    for result in results:
        typer.echo(f"{result.kind:<10} {result.uid:<28} {result.outcome}")


def _clickhouse_client(config: Path | None, clickhouse_url: str | None) -> Any:
    """The embedded store (read live through a running sink's server), or the server at --clickhouse-url."""
    from dataclasses import replace

    from pipeline.core.config import load_config
    from pipeline.core.store.connection import connect_reader

    settings = load_config(config).clickhouse
    if clickhouse_url:
        settings = replace(settings, url=clickhouse_url)
    return connect_reader(settings, database=settings.database)


def board(
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the page to this file."),
    serve_port: int | None = typer.Option(None, "--serve", help="Serve the page on 127.0.0.1:PORT instead."),
    since: str = typer.Option("1h", "--since", help="Start of the range: 15m, 2h, 1d ago, or an ISO time."),
    until: str | None = typer.Option(None, "--until", help="End of the range (ISO time or duration ago); default now."),
    model: list[str] | None = typer.Option(
        None, "--model", "-m", help="Model(s) to show; default every model in the range."
    ),
    clickhouse_url: str | None = typer.Option(
        None, "--clickhouse-url", help="ClickHouse HTTP URL (default: embedded chDB)."
    ),
    config: Path | None = ConfigOption,
) -> None:
    """The tail-latency board as a self-contained HTML page, for machines without Grafana."""
    from pipeline.core.config import ConfigError
    from pipeline.core.store.connection import ClickHouseUnavailable
    from pipeline.tools.views.board import build_page, serve
    from pipeline.tools.views.panel_data import time_range

    if (out is None) == (serve_port is None):
        typer.echo("error: give exactly one of --out FILE or --serve PORT", err=True)
        raise typer.Exit(2)
    try:
        window = time_range(since, until)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    try:
        client = _clickhouse_client(config, clickhouse_url)
    except (ConfigError, ClickHouseUnavailable, ValueError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    if serve_port is not None:
        typer.echo(f"board: http://127.0.0.1:{serve_port}/  (Ctrl-C stops)")
        try:
            serve(client, serve_port, since, model[0] if model else None)
        except KeyboardInterrupt:
            pass
        return
    assert out is not None
    page = build_page(client, window, list(model) if model else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    typer.echo(f"board: {out.resolve()} ({window.describe()})")


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.add_typer(dashboards_app, name="dashboards")
    app.command("board")(board)
