"""CLI command: `batchtide bench generation` (batchtide's decode loop against LLM servers' schedulers, by goodput)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console(width=max(Console().width, 140))


def bench_generation(
    scenario_opts: list[Path] = typer.Option(
        ..., "--scenario", "-s", help="Generation scenario TOML (scenarios/generation/); repeat for several."
    ),
    quick: bool = typer.Option(False, "--quick", help="Coarser peer grids."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the reports as JSON here."),
    peer_kernels: str = typer.Option(
        "runner",
        "--peer-kernels",
        help="What the peers' iterations cost: runner (the runner's measured kernels, as "
        "batchtide's loop) or ragged (the servers' own idealised kernels).",
    ),
) -> None:
    """Goodput (requests/s meeting both the TTFT and the TPOT objective), p99 TTFT and TPOT of
    batchtide-default (untuned) and of vLLM's, TGI's, SGLang's and the fixed window's scheduler,
    each at its best configuration of its grid, on the same simulated device."""
    from pipeline.core.sim.generation.gen_scenario import load_gen_scenario
    from pipeline.core.sim.scenario import ScenarioError
    from pipeline.tools.bench.generation import bench_scenario
    from pipeline.tools.views.tables import print_table

    if peer_kernels not in ("runner", "ragged"):
        console.print(f"[red]error:[/red] --peer-kernels must be runner or ragged (got {escape(peer_kernels)})")
        raise typer.Exit(2)
    reports = []
    for path in scenario_opts:
        try:
            scn = load_gen_scenario(path)
        except ScenarioError as e:
            console.print(f"[red]error:[/red] {escape(str(e))}")
            raise typer.Exit(2) from None
        with console.status(f"{scn.name}: batchtide-default and the peers' grids ..."):
            report = bench_scenario(scn, quick=quick, peer_kernels=peer_kernels)  # type: ignore[arg-type]
        reports.append(report)
        table = Table(
            title=f"{scn.name}: {report['requests']} requests; objectives TTFT <= {scn.ttft_ms:g} ms, "
            f"TPOT <= {scn.tpot_ms:g} ms; peers on {peer_kernels} kernels"
        )
        for column in (
            "system",
            "goodput req/s",
            "req/s",
            "met both",
            "TTFT p99 ms",
            "TPOT p99 ms",
            "e2e p99 ms",
            "expired",
            "longest gap ms",
            "runs",
            "best configuration",
        ):
            table.add_column(column, justify="left" if column in ("system", "best configuration") else "right")
        for row in report["rows"]:
            table.add_row(
                row["system"],
                f"{row['goodput_rps']:.2f}",
                f"{row['throughput_rps']:.2f}",
                f"{row['attained']:.1%}",
                _ms(row["ttft_p99_ms"]),
                _ms(row["tpot_p99_ms"], 1),
                _ms(row["e2e_p99_ms"]),
                f"{row['expired_share']:.1%}",
                _ms(row["longest_gap_ms"]),
                str(row["runs"]),
                row["config"],
            )
        print_table(console, table)
        console.print(f"  batchtide-default / best peer goodput: {report['default_vs_best_peer']:.2f}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(reports, indent=2))
        console.print(f"wrote {json_out}")


def _ms(value: float, digits: int = 0) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def register(app: typer.Typer) -> None:
    """Attach `generation` to the bench group."""
    from pipeline.tools.commands.bench import bench_app

    bench_app.command("generation")(bench_generation)
