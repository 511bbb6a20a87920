"""The `batchtide` command line. Each command group lives in pipeline/commands/."""

from __future__ import annotations

import typer

from pipeline.commands import bench, chaos, dashboards, db, demo, local, profile, serve, settings

app = typer.Typer(
    name="batchtide",
    help="Kafka-native streaming inference with rate-adaptive micro-batching.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

for module in (local, serve, bench, db, dashboards, chaos, demo, settings, profile):
    module.register(app)

if __name__ == "__main__":
    app()
