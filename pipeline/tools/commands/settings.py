"""CLI commands: `batchtide config check|reference`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

config_app = typer.Typer(help="Check a config file; print the configuration reference.", no_args_is_help=True)


@config_app.command("check")
def check(path: Annotated[Path, typer.Argument(help="TOML config file.")]) -> None:
    """Validate a config file and print each model's effective profile."""
    from pipeline.core.config import ConfigError, load_config

    try:
        cfg = load_config(path)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{path}: ok ({len(cfg.models)} models)")
    for name, model in cfg.models.items():
        p = model.profile
        typer.echo(
            f"  {name}: runner={model.runner} target={p.target_size} hard_cap={p.hard_cap} "
            f"max_wait_ms={p.max_wait_ms} tail_mark_ratio={p.tail_mark_ratio} cost_unit={p.cost_unit}"
        )


@config_app.command("reference")
def reference(
    write: Annotated[
        Path | None,
        typer.Option("--write", help="Replace the marked reference in this document (docs/configuration.md)."),
    ] = None,
) -> None:
    """Print every config key with its default and meaning (Markdown, as in docs/configuration.md)."""
    from pipeline.core.config_reference import reference_markdown, write_into

    if write is None:
        typer.echo(reference_markdown(), nl=False)
        return
    typer.echo(f"{write}: {'updated' if write_into(str(write)) else 'already current'}")


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
