"""A root app holding only the dashboards command group, so these tests do not
depend on other command groups importing cleanly."""

import typer

from pipeline.tools.commands import dashboards


def dashboards_cli() -> typer.Typer:
    app = typer.Typer()
    dashboards.register(app)
    return app
