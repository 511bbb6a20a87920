"""CLI commands: bench (placeholder until its issue lands)."""

import typer


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
