"""CLI command: `batchtide chaos [SCENARIO|all]` runs the fault scenarios by hand and prints the table.

The scenarios are the very ones `tests/faults/` asserts on (pipeline.tools.chaos);
here they run with longer defaults (60 s overload, 20 s outages) on a private
broker in a temporary directory, and the exit code says whether every
promise held.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from pipeline.tools.chaos.ledger import FaultReport


def chaos(
    scenario: str = typer.Argument(
        "all",
        help="A scenario name, `all` (the single-broker rows), `cluster` (the three-broker rows) or `share` (the "
        "share-group rows). `--list` shows the names.",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the rows (with details) as JSON here."),
    quick: bool = typer.Option(False, "--quick", help="The test suite's short sizes (15 s overload, 10 s outages)."),
    outage_s: float | None = typer.Option(None, help="Broker/ClickHouse outage length in seconds (default 20)."),
    freeze_s: float | None = typer.Option(None, help="How long broker-freeze SIGSTOPs a broker (default 30)."),
    overload_s: float | None = typer.Option(None, help="Overload phase length in seconds (default 60)."),
    rate: float | None = typer.Option(None, help="Steady arrival rate, requests/s (default 80)."),
    requests: int | None = typer.Option(None, help="Requests per steady scenario (default 1600)."),
    workdir: Path | None = typer.Option(None, help="Keep broker data, configs and process logs here."),
    list_only: bool = typer.Option(False, "--list", help="List the scenarios and exit."),
) -> None:
    """Inject faults into a real local pipeline and report lost and duplicated requests."""
    import dataclasses

    from pipeline.tools.chaos.catalogue import CLUSTER, SCENARIOS, SHARE, SINGLE_BROKER, report_rows, run_scenarios
    from pipeline.tools.chaos.steps import ChaosSizes

    if list_only:
        width = max(len(name) for name in SCENARIOS)
        for name, entry in SCENARIOS.items():
            where = "  (3-broker cluster)" if entry.cluster else ""
            typer.echo(f"{name:{width}}  {entry.summary}{where}")
        return
    names = {"all": SINGLE_BROKER, "cluster": CLUSTER, "share": SHARE}.get(scenario, [scenario])
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        typer.echo(
            f"error: unknown scenario {unknown[0]!r}; known: all, cluster, share, {', '.join(SCENARIOS)}", err=True
        )
        raise typer.Exit(2)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    sizes = ChaosSizes.quick() if quick else ChaosSizes()
    overrides: dict[str, Any] = {
        "outage_s": outage_s,
        "freeze_s": freeze_s,
        "overload_s": overload_s,
        "rate_rps": rate,
        "requests": requests,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    if any(v <= 0 for v in given.values()):
        typer.echo("error: --outage-s, --freeze-s, --overload-s, --rate and --requests must be > 0", err=True)
        raise typer.Exit(2)
    sizes = dataclasses.replace(sizes, **given)
    keep = workdir is not None
    base = workdir or Path(tempfile.mkdtemp(prefix="batchtide-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        reports = asyncio.run(run_scenarios(names, sizes, base.resolve()))
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    _print_table(reports)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report_rows(reports), indent=2) + "\n")
        typer.echo(f"wrote {json_out}")
    if not all(r.passed for r in reports):
        raise typer.Exit(1)


def _print_table(reports: list[FaultReport]) -> None:
    from rich.console import Console
    from rich.table import Table

    from pipeline.tools.views.tables import print_table

    table = Table(title="batchtide chaos: every fault, every request accounted for")
    for column in ("fault", "injections", "requests in", "results out", "lost", "duplicated", "recovery s", "verdict"):
        table.add_column(column, justify="left" if column in ("fault", "verdict") else "right")
    for r in reports:
        dup = f"{r.duplicated}" + (f" (≤{r.duplicate_bound})" if r.duplicate_bound else "")
        recovery = "-" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        verdict = "ok" if r.passed else "FAIL"
        table.add_row(
            r.fault, str(r.injections), str(r.requests_in), str(r.results_out), str(r.lost), dup, recovery, verdict
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    print_table(console, table)
    for r in reports:
        details = ", ".join(f"{k}={v}" for k, v in r.details.items())
        console.print(f"[bold]{r.fault}[/bold]: {details}", highlight=False)
        for failure in r.failures:
            console.print(f"  [red]FAIL[/red] {failure}", highlight=False)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("chaos")(chaos)
