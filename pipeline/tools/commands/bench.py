"""CLI commands: `batchtide bench policies`, `bench suite` (simulated policy bench) and
`bench fleet` (a simulated consumer group, balanced or not).

Other bench commands (`bench pipeline`) attach themselves to `bench_app`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.tools.views.tables import print_table

bench_app = typer.Typer(
    help="Benchmarks: simulated policy bench (policies, suite) and the real pipeline bench.",
    no_args_is_help=True,
)

console = Console(width=max(Console().width, 120))


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _config_text(row: dict[str, Any]) -> str:
    if row["policy"].startswith("batchtide-"):
        return "BatchProfile() defaults" + (", tail_mark_ratio=0" if row["policy"].endswith("nomark") else "")
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in row["config"].items())


def _policy_table(report: dict[str, Any]) -> Table:
    t = Table(
        title=f"{report['scenario']}  (SLO p99 {report['slo_p99_ms']:g} ms, "
        f"physical limit {report['physical_limit_rps']:.0f} req/s)"
    )
    for col in (
        "policy",
        "capacity@SLO",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "wait p99",
        "req/s",
        "goodput",
        "batch",
        "hit busy/idle",
        "marked",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in report["policies"]:
        t.add_row(
            r["policy"],
            _fmt(r["capacity_at_slo"], 3),
            _fmt(r["p50_ms"]),
            _fmt(r["p99_ms"]),
            _fmt(r["p999_ms"]),
            _fmt(r["queue_wait_p99_ms"]),
            _fmt(r["throughput_rps"]),
            _fmt(r["goodput_rps"]),
            _fmt(r["mean_batch_size"], 1),
            f"{_fmt(r['hit_ratio_busy'], 2)}/{_fmt(r['hit_ratio_idle'], 2)}",
            _fmt(r["marked_share"], 3),
        )
    return t


def _goodput_table(report: dict[str, Any]) -> Table:
    t = Table(
        title=f"{report['scenario']}: goodput (requests/s served within the {report['slo_p99_ms']:g} ms SLO; "
        f"deadline {report['deadline_ms']:g} ms)"
    )
    for col in ("load", "batchtide-default", "share in SLO", "expired", "best peer", "its goodput", "ratio"):
        t.add_column(col, justify="left" if col == "best peer" else "right", no_wrap=True)
    for row in report["goodput"]:
        me, peer = row["batchtide_default"], row["best_peer"]
        ratio = f"{row['ratio']:.3f}"
        t.add_row(
            f"x{row['load']:.2f}",
            _fmt(me["goodput_rps"], 1),
            _fmt(me["good_share"], 3),
            _fmt(me["expired_share"], 3),
            f"{peer['policy']} ({_config_text({'policy': peer['policy'], 'config': peer['config']})})",
            _fmt(peer["goodput_rps"], 1),
            ratio if row["meets_target"] else f"[red]{ratio}[/red]",
        )
    return t


def _print_report(report: dict[str, Any]) -> None:
    print_table(console, _policy_table(report))
    if report.get("goodput"):
        print_table(console, _goodput_table(report))
    for r in report["policies"]:
        console.print(f"  [dim]{r['policy']}:[/dim] {_config_text(r)}")
    we = report.get("window_effect")
    if we:
        g, w = we["greedy"], we["windowed"]
        console.print(
            f"  window effect (fixed-window family): greedy {g['config']} capacity "
            f"{g['capacity_at_slo']:.3f} p99 {_fmt(g['p99_ms'])} ms; best with a window {w['config']} "
            f"capacity {w['capacity_at_slo']:.3f} p99 {_fmt(w['p99_ms'])} ms"
        )


def _progress() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed} runs"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


@bench_app.command("policies")
def policies(
    scenario: Path = typer.Option(..., "--scenario", "-s", help="Scenario TOML file (see docs/benchmarks.md)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write PNG plots into this directory."),
    quick: bool = typer.Option(False, "--quick", help="Coarser grids (seconds instead of a minute)."),
    profile: Path | None = typer.Option(
        None, "--profile", help="Device profile JSON (batchtide profile): replaces the scenario's \\[cost]."
    ),
) -> None:
    """Grid-search every batching policy family on one scenario and compare with batchtide-default."""
    from pipeline.core.profile_file import ProfileError, load_profile
    from pipeline.core.sim.scenario import ScenarioError
    from pipeline.core.sim.scenario_file import load_scenario, with_cost
    from pipeline.core.sim.search import Evaluator
    from pipeline.tools.bench.policy import bench_policies

    try:
        scn = load_scenario(scenario)
        if scn.fleet is not None:
            raise ScenarioError(
                f"{scenario}: a [fleet] scenario studies a consumer group: run it with `batchtide bench fleet`"
            )
        if profile is not None:
            scn = with_cost(scn, load_profile(profile).scenario_cost(), str(profile))
    except (ScenarioError, ProfileError) as e:
        console.print(f"[red]scenario error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    with _progress() as prog:
        task = prog.add_task(scn.name, total=None)
        ev = Evaluator(scn, on_run=lambda: prog.advance(task))
        result = bench_policies(scn, quick, lambda label: prog.update(task, description=label), ev)
    report = result.as_json()
    _print_report(report)
    console.print(
        f"simulator: {report['simulator_requests_per_s']:,.0f} requests/s over {report['simulated_runs']} runs"
    )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {json_out}")
    if plot:
        from pipeline.tools.bench.plots import write_plots

        for path in write_plots(result, plot):
            console.print(f"wrote {path}")


@bench_app.command("suite")
def suite(
    json_out: Path | None = typer.Option(None, "--json", help="Write the suite report as JSON here."),
    scenarios: Path = typer.Option(Path("scenarios"), "--scenarios", help="Directory of scenario TOML files."),
    quick: bool = typer.Option(False, "--quick", help="Coarser grids."),
    jobs: int = typer.Option(2, "--jobs", "-j", min=1, help="Scenarios benched in parallel processes."),
) -> None:
    """Run every scenario: batchtide-default vs each family's per-scenario oracle best and the
    seed baseline, plus the best single fixed config across the suite and its regret."""
    from pipeline.tools.bench.policy import CAPACITY_TARGET, P99_TARGET, bench_suite, scenario_files

    if not scenario_files(scenarios):
        console.print(f"[red]no *.toml scenarios in {scenarios}[/red]")
        raise typer.Exit(2)
    with _progress() as prog:
        task = prog.add_task("suite", total=None)
        result = bench_suite(
            scenarios,
            quick,
            lambda label: prog.update(task, description=label),
            on_run=lambda: prog.advance(task),
            jobs=jobs,
        )
    report = result.as_json()
    for b in report["scenarios"]:
        _print_report(b)
    t = Table(
        title=f"batchtide-default vs each family's oracle best "
        f"(capacity ratio >= {CAPACITY_TARGET}, p99 ratio <= {P99_TARGET})"
    )
    t.add_column("scenario")
    families_seen: list[str] = []
    for c in report["comparisons"]:
        for f in c["vs"]:
            if f not in families_seen and f not in ("batchtide-nomark",):
                families_seen.append(f)
    for f in families_seen:
        t.add_column(f, justify="right")
    t.add_column("all met", justify="center")
    for c in report["comparisons"]:
        cells = []
        for f in families_seen:
            v = c["vs"].get(f)
            if v is None:
                cells.append("-")
                continue
            text = f"{_fmt(v['capacity_ratio'], 2)} / {_fmt(v['p99_ratio'], 2)}"
            cells.append(text if v["meets_targets"] or f == "seed-baseline" else f"[red]{text}[/red]")
        t.add_row(c["scenario"], *cells, "yes" if c.get("meets_all_family_targets") else "[red]no[/red]")
    print_table(console, t)
    console.print("cells: capacity ratio / p99 ratio of batchtide-default against that row's policy")
    bf = report["best_single_fixed_config"]
    if bf:
        console.print(
            f"best single fixed config across the suite: {bf['config']} — worst capacity ratio "
            f"{bf['worst_capacity_ratio']:.3f} on {bf['worst_scenario']} "
            f"(regret {bf['regret']:.1%}), worst p99 ratio {bf['worst_p99_ratio']:.2f}"
        )
    goodput = [c for c in report["comparisons"] if c.get("goodput_ratio")]
    if goodput:
        g = Table(
            title=f"goodput with deadlines: batchtide-default / the best tuned peer per load "
            f"(target >= {report['targets']['goodput_ratio_min']})"
        )
        g.add_column("scenario")
        loads = list(goodput[0]["goodput_ratio"])
        for load in loads:
            g.add_column(f"x{float(load):.2f}", justify="right")
        for c in goodput:
            g.add_row(c["scenario"], *(_fmt(c["goodput_ratio"].get(load), 3) for load in loads))
        print_table(console, g)
    dw = report["batchtide_default_worst"]
    if dw:
        console.print(
            f"batchtide-default: worst capacity ratio {dw['worst_capacity_ratio']:.3f} on "
            f"{dw['worst_scenario']} (regret {dw['regret']:.1%})"
        )
    console.print(f"simulator: {report['simulator_requests_per_s']:,.0f} requests/s")
    for note in report["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {json_out}")


def _consumer_cells(run: dict[str, Any], stragglers: list[int]) -> str:
    """Who carried the run: every consumer of a small group; the stragglers and the range of the
    others in a large one."""

    def cell(c: dict[str, Any]) -> str:
        return f"c{c['consumer']} {_fmt(c['p99_ms'])} ms {c['share']:.0%}"

    per = run["consumers"]
    if len(per) <= 4:
        return ", ".join(cell(c) for c in per)
    others = [c for c in per if c["consumer"] not in stragglers]
    p99s = [c["p99_ms"] for c in others if c["p99_ms"] is not None]
    shares = [c["share"] for c in others]
    text = ", ".join(cell(per[c]) for c in stragglers)
    if others:
        text += (
            f"{', ' if text else ''}others p99 {_fmt(min(p99s) if p99s else None)}-"
            f"{_fmt(max(p99s) if p99s else None)} ms, {min(shares):.1%}-{max(shares):.1%} each"
        )
    return text


def _fleet_table(report: dict[str, Any]) -> Table:
    t = Table(
        title=f"{report['scenario']}  ({report['consumers']} consumers, {report['partitions']} partitions, "
        f"{report['rate_per_s']:.0f} req/s, {report['duration_s']:g} s)"
    )
    recovery = any(report["runs"][v]["recovered_p99_ms"] is not None for v in report["runs"])
    cols = ["run", "p50 ms", "p99 ms", "p999 ms", "p99 / ideal", "forwarded"]
    if recovery:
        cols.append("p99 15 s after")
    cols.append("per consumer: p99, share")
    for col in cols:
        t.add_column(col, justify="left" if col in ("run", cols[-1]) else "right", no_wrap=col != cols[-1])
    ideal = report["runs"]["ideal"]["p99_ms"]
    labels = {
        "off": "balance off",
        "on": "balance on",
        "weighted": "weighted assignment",
        "weighted+on": "weighted + balance",
        "ideal": "ideal (all fast)",
    }
    for variant, run in report["runs"].items():
        row = [
            labels[variant],
            _fmt(run["p50_ms"]),
            _fmt(run["p99_ms"]),
            _fmt(run["p999_ms"]),
            _fmt(run["p99_ms"] / ideal if ideal else None, 2),
            f"{run['forwarded_share']:.1%}",
        ]
        if recovery:
            row.append(_fmt(run["recovered_p99_ms"]))
        row.append(_consumer_cells(run, report["stragglers"]))
        t.add_row(*row)
    return t


@bench_app.command("fleet")
def fleet(
    scenario_args: list[Path] = typer.Argument(None, metavar="[SCENARIO]...", help="Fleet scenario TOML files."),
    scenario_opts: list[Path] = typer.Option(
        [], "--scenario", "-s", help="A fleet scenario TOML file ([fleet] table; repeatable)."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the reports as JSON here."),
) -> None:
    """Simulate a consumer group per scenario: balance off (today), on (group-relative
    forwarding) and the ideal all-fast group, with p99 ratios to the ideal."""
    from pipeline.core.sim.scenario import ScenarioError
    from pipeline.tools.bench.fleet_simulated import bench_fleet, fleet_scenario

    paths = list(scenario_opts) + list(scenario_args or [])
    if not paths:
        console.print("[red]give at least one fleet scenario (e.g. scenarios/fleet-*.toml)[/red]")
        raise typer.Exit(2)
    try:
        scenarios = [fleet_scenario(p) for p in paths]
    except ScenarioError as e:
        console.print(f"[red]scenario error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    reports = []
    for scn in scenarios:
        with console.status(f"{scn.name}: 3 runs"):
            report = bench_fleet(scn)
        reports.append(report)
        console.print(_fleet_table(report))
        r = report["ratios"]
        console.print(
            f"  p99 vs ideal: off x{_fmt(r['off_p99_vs_ideal'], 2)}, on x{_fmt(r['on_p99_vs_ideal'], 2)}; "
            f"on vs off x{_fmt(r['on_p99_vs_off'], 2)}   (simulator "
            f"{_fmt(report['simulator_requests_per_s'])} requests/s)"
        )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(reports, indent=2))
        console.print(f"wrote {json_out}")


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.add_typer(bench_app, name="bench")
