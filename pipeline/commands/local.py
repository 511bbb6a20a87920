"""CLI commands: `batchtide local ...` (a local Kafka broker) and `batchtide topics ...`."""

from __future__ import annotations

import time

import typer

local_app = typer.Typer(help="Run a local single-node Kafka broker (KRaft) for development.", no_args_is_help=True)


@local_app.command("fetch")
def fetch() -> None:
    """Resolve Apache Kafka's jars into ~/.cache/batchtide (once; later runs are no-ops)."""
    from consumers.localkafka import KafkaSetupError, ensure_kafka_jars

    started = time.monotonic()
    try:
        libs = ensure_kafka_jars()
    except KafkaSetupError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"kafka jars: {libs} ({time.monotonic() - started:.1f} s)")


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.add_typer(local_app, name="local")
