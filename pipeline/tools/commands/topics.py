"""CLI command group `batchtide topics`: the pipeline's Kafka topics, on any broker the config names."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.config import ConfigError, load_config

topics_app = typer.Typer(help="Kafka topics of the pipeline.", no_args_is_help=True)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


@topics_app.command("create")
def create(
    config: Annotated[Path | None, typer.Option("--config", help="batchtide TOML config.")] = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="Model name (repeatable).")] = None,
    partitions: Annotated[
        list[int] | None, typer.Option("--partitions", help="Partitions of the --model at the same position.")
    ] = None,
    bootstrap: Annotated[str | None, typer.Option(help="Override kafka.bootstrap_servers.")] = None,
) -> None:
    """Create the request, priority and result topics of every model, plus events and DLQ topics."""
    from pipeline.core.kafka.client import ensure_topics

    try:
        cfg = load_config(config)
    except ConfigError as e:
        raise _fail(str(e)) from None
    models = {name: m.partitions for name, m in cfg.models.items()}
    names, counts = model or [], partitions or []
    if counts and len(counts) != len(names):
        raise _fail("give one --partitions per --model (or none to use 4 each)")
    for i, name in enumerate(names):
        models[name] = counts[i] if counts else models.get(name, 4)
    if not models:
        raise _fail("no models: pass --config FILE with [models.*] tables, or --model NAME")
    settings = cfg.kafka if bootstrap is None else dataclasses.replace(cfg.kafka, bootstrap_servers=bootstrap)
    try:
        created = asyncio.run(ensure_topics(settings, models))
    except ConfigError as e:
        raise _fail(str(e)) from None
    except Exception as e:
        raise _fail(f"could not create topics on {settings.bootstrap_servers}: {e!r}") from None
    for name, count in sorted(created.items()):
        typer.echo(f"{name}  partitions={count}")
    if cfg.consumer.group_type == "share":
        from consumers.sharing import layout_warning
        from pipeline.core.config import ModelConfig
        from pipeline.core.kafka.client import Topics

        topics = Topics(settings.topic_prefix)
        for name in sorted(models):
            warning = layout_warning(
                cfg.models.get(name, ModelConfig(name=name)), created.get(topics.requests(name), 0)
            )
            if warning:
                typer.echo(f"warning: {warning}", err=True)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.add_typer(topics_app, name="topics")
