"""CLI command group `batchtide bench`: `policies`, `suite` (the simulated policy bench), `fleet` (a simulated
consumer group, balanced or not), `pipeline` and `fleet-live` (the real pipeline end to end, on a broker) and
`generation` (batchtide's decode loop against LLM servers' schedulers, by goodput), `share-partition` (what one
request partition carries for a share group).
"""

from __future__ import annotations

import asyncio
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
wide_console = Console(width=max(Console().width, 140))
"""`bench generation`'s tables are wider."""


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


@bench_app.command("pipeline")
def bench_pipeline(
    find_max: bool = typer.Option(
        False, "--find-max", help="Zero-cost runner: ramp the rate to the max sustained req/s."
    ),
    rates: str | None = typer.Option(None, "--rates", help="Comma-separated offered rates (req/s) for --runner."),
    runner: str = typer.Option(
        "minilm", "--runner", help="Runner for --rates: minilm, smollm (generation), zero-cost or cost-model."
    ),
    duration: float = typer.Option(30.0, "--duration", help="Seconds per offered rate of --rates."),
    find_max_duration: float = typer.Option(8.0, "--find-max-duration", help="Seconds per --find-max trial."),
    seed: int = typer.Option(1, "--seed"),
    torch_threads: int = typer.Option(1, "--torch-threads", help="torch threads of each consumer (minilm)."),
    bootstrap: str | None = typer.Option(None, "--bootstrap", help="Use this broker instead of starting a local one."),
    consumers: int = typer.Option(1, "--consumers", help="Consumer processes in the group."),
    partitions: int = typer.Option(4, "--partitions", help="Partitions of the request topic."),
    hot_share: float = typer.Option(0.0, "--hot-share", help="Share of requests sent to partition 0 (skewed load)."),
    forwarding: bool = typer.Option(True, "--forwarding/--no-forwarding", help="Tail forwarding in the consumers."),
    tokens: int = typer.Option(24, "--tokens", help="Approximate tokens per request text."),
    late_consumer_s: float | None = typer.Option(
        None, "--late-consumer-s", help="Start the last consumer this many seconds into the load (rebalance cost)."
    ),
    adaptive_cap: bool = typer.Option(
        True, "--adaptive-cap/--no-adaptive-cap", help="Engine learns the cap (default) or holds --hard-cap."
    ),
    hard_cap: int = typer.Option(48, "--hard-cap", help="Batch size cap of the consumers' profile."),
    cost_a_ms: float = typer.Option(5.0, "--cost-a-ms", help="cost-model runner: fixed ms per batch."),
    cost_c_ms: float = typer.Option(0.5, "--cost-c-ms", help="cost-model runner: ms per request."),
    isolation: str = typer.Option(
        "auto", "--isolation", help="Where the consumers run batches: auto, process or thread."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the figures as JSON here."),
    modes: str = typer.Option(
        "static,iteration,fixed", "--modes", help="smollm: batching modes to run (static, iteration, fixed)."
    ),
    equal_tokens: int = typer.Option(64, "--equal-tokens", help="smollm: max_new_tokens of the all-equal load."),
    lengths: str = typer.Option(
        "mixed,equal", "--lengths", help="smollm: length mixes to run (mixed, equal, lognormal, short, long)."
    ),
    step_token_budget: str | None = typer.Option(
        None,
        "--step-token-budget",
        help="smollm, iteration: the consumer's step_token_budget (chunked prefill; 0 off); several (0,64) run each.",
    ),
    chunk_fusion: str | None = typer.Option(
        None,
        "--chunk-fusion",
        help="smollm, iteration: the consumer's fused_chunks, on or off (chunks ride in decode steps, or run as passes of their own); on,off runs each (not for budget 0).",
    ),
    ttft_slo_ms: float | None = typer.Option(
        None,
        "--ttft-slo-ms",
        help="smollm: TTFT objective of the goodput column (default 5000; with --trace from the profiled device).",
    ),
    tpot_slo_ms: float | None = typer.Option(
        None,
        "--tpot-slo-ms",
        help="smollm: TPOT objective of the goodput column (default 500; with --trace from the profiled device).",
    ),
    trace: Path | None = typer.Option(
        None,
        "--trace",
        help="smollm: replay a slice of this LLM trace (as `produce --trace`) into a batchtide-default consumer, "
        "instead of --rates, and simulate the same slice beside it.",
    ),
    trace_start: float = typer.Option(0.0, "--start", help="--trace: window start, seconds of the trace's own time."),
    trace_window: float | None = typer.Option(
        None, "--window", help="--trace: window length, seconds of the trace's own time (default: to the end)."
    ),
    length_scale: float = typer.Option(1.0, "--length-scale", help="--trace: multiply prompt and answer tokens."),
    answer_scale: float | None = typer.Option(
        None, "--answer-scale", help="--trace: multiply answer tokens by this instead of --length-scale."
    ),
    time_scale: float | None = typer.Option(None, "--time-scale", help="--trace: multiply arrival times."),
    trace_load: float | None = typer.Option(
        None,
        "--trace-load",
        help="--trace: instead of --time-scale, the share of the machine's generation limit the slice offers.",
    ),
    profile_in_run: bool = typer.Option(
        False,
        "--profile-in-run",
        help="smollm: profile the model first, in this run, for the machine limit and token cap.",
    ),
    llm_profile: Path | None = typer.Option(
        Path("var/profiles/smollm.json"), "--profile", help="smollm: profile file (token cap, machine limit)."
    ),
    timeout_ms: int | None = typer.Option(
        None,
        "--timeout-ms",
        help="Deadline of every request (expired past it): overload with deadlines; RSS is printed per run.",
    ),
    straggler: float = typer.Option(
        1.0, "--straggler", help="cost-model: consumer 0's t(b) multiplied by this (a slower device in the group)."
    ),
    slowdown: str | None = typer.Option(
        None,
        "--slowdown",
        help="cost-model: FROM:TO:FACTOR, consumer 0's t(b) times FACTOR from FROM to TO seconds into the load.",
    ),
    record: Path | None = typer.Option(
        None,
        "--record",
        help="Keep each trial in a directory of its own under this one for `batchtide replay`: the consumers' config and profile, and an embedded ClickHouse store the sink fills from the trial's events; the replay commands are printed at the end.",
    ),
) -> None:
    """Real pipeline bench: open-loop producer -> Kafka -> consumer process(es) -> results, end to end."""
    import logging

    from pipeline.tools.bench.pipeline.lengths import MIXES
    from pipeline.tools.bench.pipeline.options import ISOLATIONS, LLM_MODES, RUNNERS, BenchOptions
    from pipeline.tools.bench.pipeline.run import run_bench
    from pipeline.tools.commands.literal_choice import pick

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # new topics log transient leader errors
    runner_choice = pick(runner, RUNNERS)
    if runner_choice is None:
        typer.echo(f"error: --runner must be minilm, smollm, zero-cost or cost-model (got {runner!r})", err=True)
        raise typer.Exit(2)
    isolation_choice = pick(isolation, ISOLATIONS)
    if isolation_choice is None:
        typer.echo(f"error: --isolation must be auto, process or thread (got {isolation!r})", err=True)
        raise typer.Exit(2)
    if timeout_ms is not None and timeout_ms <= 0:
        typer.echo(f"error: --timeout-ms must be > 0 (got {timeout_ms})", err=True)
        raise typer.Exit(2)
    window = parse_slowdown(slowdown) if slowdown else None
    if (straggler != 1.0 or window) and runner != "cost-model":
        typer.echo("error: --straggler and --slowdown need --runner cost-model", err=True)
        raise typer.Exit(2)
    if straggler <= 0:
        typer.echo(f"error: --straggler must be > 0 (got {straggler})", err=True)
        raise typer.Exit(2)
    if trace is not None and (runner != "smollm" or rates is not None or find_max):
        typer.echo("error: --trace replays into --runner smollm, without --rates or --find-max", err=True)
        raise typer.Exit(2)
    if trace is not None and (time_scale is None) == (trace_load is None):
        typer.echo("error: --trace needs one of --time-scale X and --trace-load SHARE", err=True)
        raise typer.Exit(2)
    if not find_max and rates is None and trace is None:
        typer.echo("error: give --find-max and/or --rates R1,R2,...", err=True)
        raise typer.Exit(2)
    try:
        offered = tuple(float(r) for r in rates.split(",")) if rates else ()
    except ValueError:
        typer.echo(f"error: --rates must be numbers separated by commas (got {rates!r})", err=True)
        raise typer.Exit(2) from None
    options = BenchOptions(
        runner=runner_choice,
        rates=offered,
        duration_s=duration,
        find_max_duration_s=find_max_duration,
        seed=seed,
        torch_threads=torch_threads,
        bootstrap=bootstrap,
        partitions=partitions,
        consumers=consumers,
        tokens=tokens,
        hot_share=hot_share,
        tail_forwarding=forwarding,
        cost_a_ms=cost_a_ms,
        cost_c_ms=cost_c_ms,
        adaptive_cap=adaptive_cap,
        hard_cap=hard_cap,
        late_consumer_s=late_consumer_s,
        isolation=isolation_choice,
        llm_profile=str(llm_profile) if llm_profile else None,
        timeout_ms=timeout_ms,
        straggler=straggler,
        slowdown=window,
        ttft_slo_ms=ttft_slo_ms if ttft_slo_ms is not None else (0.0 if trace else 5000.0),
        tpot_slo_ms=tpot_slo_ms if tpot_slo_ms is not None else (0.0 if trace else 500.0),
        record_dir=str(record) if record else None,
    )
    if trace is not None:
        from pipeline.core.sim.generation.trace import TraceError, TraceSlice

        try:
            part = TraceSlice(time_scale or 1.0, length_scale, trace_start, trace_window, answer_scale)
        except TraceError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        figures = asyncio.run(
            run_bench(
                options,
                find_max_mode=False,
                rates_mode=False,
                say=typer.echo,
                profile_now=profile_in_run,
                trace=(trace, part, trace_load),
            )
        )
        if json_out is not None:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(figures, indent=2))
            typer.echo(f"wrote {json_out}")
        return
    mix_list = tuple(m.strip() for m in lengths.split(",") if m.strip())
    if runner == "smollm" and not set(mix_list) <= set(MIXES):
        typer.echo(f"error: --lengths takes {', '.join(MIXES)} (got {lengths!r})", err=True)
        raise typer.Exit(2)
    try:
        budgets: tuple[int | None, ...] = (
            tuple(int(b) for b in step_token_budget.split(",")) if step_token_budget else (None,)
        )
    except ValueError:
        budgets = (-1,)
    if any(b is not None and b < 0 for b in budgets):
        typer.echo(
            f"error: --step-token-budget takes whole numbers >= 0 separated by commas (got {step_token_budget!r})",
            err=True,
        )
        raise typer.Exit(2)
    switch = {"on": True, "off": False}
    fusion_words = [w.strip() for w in chunk_fusion.split(",") if w.strip()] if chunk_fusion else []
    if not set(fusion_words) <= set(switch) or (chunk_fusion and not fusion_words):
        typer.echo(f"error: --chunk-fusion takes on and off separated by commas (got {chunk_fusion!r})", err=True)
        raise typer.Exit(2)
    fusions: tuple[bool | None, ...] = tuple(switch[w] for w in fusion_words) or (None,)
    picked = [pick(m.strip(), LLM_MODES) for m in modes.split(",") if m.strip()]
    mode_list = tuple(m for m in picked if m is not None)
    if runner == "smollm" and len(mode_list) < len(picked):
        typer.echo(f"error: --modes takes static, iteration and fixed (got {modes!r})", err=True)
        raise typer.Exit(2)
    figures = asyncio.run(
        run_bench(
            options,
            find_max_mode=find_max,
            rates_mode=bool(offered),
            say=typer.echo,
            llm_modes_list=mode_list,
            equal_tokens=equal_tokens,
            llm_mixes=mix_list,
            profile_now=profile_in_run,
            budgets=budgets,
            fusions=fusions,
        )
    )
    if find_max:
        typer.echo(
            f"zero-cost: max sustained {figures['zero_cost_max_rps']:.0f} req/s; "
            f"added latency at half: p50 {figures.get('zero_cost_added_p50_ms', float('nan')):.1f} ms, "
            f"p99 {figures.get('zero_cost_added_p99_ms', float('nan')):.1f} ms"
        )
    if offered and runner != "smollm":
        for rate in figures["model_p99_ms"]:
            typer.echo(
                f"{runner} @ {rate} req/s: p50 {figures['model_p50_ms'][rate]:.1f} ms, p99 {figures['model_p99_ms'][rate]:.1f} ms, "
                f"p999 {figures['model_p999_ms'][rate]:.1f} ms, {figures['model_rps_by_rate'][rate]:.1f} req/s, "
                f"{figures['model_tokens_per_s_by_rate'][rate]:.0f} tokens/s"
            )
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(figures, indent=2))
        typer.echo(f"wrote {json_out}")


@bench_app.command("fleet-live")
def bench_fleet_live(
    cases: str | None = typer.Option(
        None,
        "--cases",
        help="Comma-separated case names (default: every cost-model case); their baselines run too. "
        "`generation` runs the SmolLM2 cases (gen-2-equal, gen-2-slow, gen-2-slowdown).",
    ),
    duration_scale: float = typer.Option(
        1.0, "--duration-scale", help="Multiply every case's duration (and slowdown window) by this."
    ),
    seed: int = typer.Option(1, "--seed"),
    bootstrap: str | None = typer.Option(None, "--bootstrap", help="Use this broker instead of starting a local one."),
    partitions: int = typer.Option(4, "--partitions", help="Partitions of the request topic."),
    repeats: int = typer.Option(
        1,
        "--repeats",
        help="Run each case's off/on pair this many times (a new seed each; generation cases reverse the order "
        "every other repeat) and report the median trial.",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write every row, with its whole trial, as JSON here."),
    gen_rate: float | None = typer.Option(
        None, "--gen-rate", help="Generation cases: requests per second offered to the pair (default 1.6)."
    ),
    balance: str = typer.Option(
        "both",
        "--balance",
        help="Generation cases: run each with the balance off, on or both (off first; on,off: on first); the "
        "all-equal pair with the balance on runs in every invocation as the slow cases' reference.",
    ),
    modes: str = typer.Option(
        "off,on,share",
        "--modes",
        help="Cost-model cases, comma-separated: off (partition group, no balance), on (tail forwarding), "
        "share (a share group).",
    ),
) -> None:
    """A consumer group with a slow member, on the real pipeline: each cost-model case as a partition
    group with its balance off (Kafka's equal partition counts) and on (tail forwarding), and as a share
    group; p99 against the all-fast group of the same run and mode. The generation cases run SmolLM2 on
    pinned cores, the slow one sharing its core with a busy process (balance off, on or both)."""
    import logging
    import tempfile

    from pipeline.tools.bench import fleet_generation
    from pipeline.tools.bench.fleet_live import CASES, MODES, fleet_table, run_fleet
    from pipeline.tools.bench.pipeline.options import BenchOptions
    from pipeline.tools.bench.pipeline.run import bench_broker

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    asked = tuple(c.strip() for c in cases.split(",") if c.strip()) if cases else ()
    expanded = [n for name in asked for n in (fleet_generation.NAMES if name == "generation" else (name,))]
    generation = tuple(n for n in expanded if n in fleet_generation.NAMES)
    names = tuple(n for n in expanded if n not in fleet_generation.NAMES)
    known = [c.name for c in CASES] + ["generation", *fleet_generation.NAMES]
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        typer.echo(f"error: unknown case(s) {sorted(unknown)}; cases: {known}", err=True)
        raise typer.Exit(2)
    balances = {"off": (False,), "on": (True,), "both": (False, True), "on,off": (True, False)}.get(balance)
    if balances is None:
        typer.echo(f"error: --balance takes off, on, both or on,off (got {balance!r})", err=True)
        raise typer.Exit(2)
    if gen_rate is not None and gen_rate <= 0:
        typer.echo(f"error: --gen-rate must be > 0 (got {gen_rate})", err=True)
        raise typer.Exit(2)
    if duration_scale <= 0:
        typer.echo(f"error: --duration-scale must be > 0 (got {duration_scale})", err=True)
        raise typer.Exit(2)
    if repeats < 1:
        typer.echo(f"error: --repeats must be >= 1 (got {repeats})", err=True)
        raise typer.Exit(2)
    wanted = {m.strip() for m in modes.split(",") if m.strip()}
    chosen = tuple(m for m in MODES if m in wanted)
    if not chosen or wanted - set(MODES):
        typer.echo(f"error: --modes takes some of {', '.join(MODES)} (got {modes!r})", err=True)
        raise typer.Exit(2)
    base = BenchOptions(seed=seed, bootstrap=bootstrap, partitions=partitions)

    async def main() -> dict[str, Any]:
        workdir = Path(tempfile.mkdtemp(prefix="batchtide-fleet-"))
        figures: dict[str, Any] = {}
        async with bench_broker(bootstrap, workdir, typer.echo) as kafka:
            if names or not generation:
                figures |= await run_fleet(
                    base,
                    kafka,
                    workdir,
                    typer.echo,
                    names,
                    duration_scale,
                    repeats,
                    chosen,
                )
            if generation:
                rate = gen_rate or fleet_generation.DEFAULT_RATE
                figures |= await fleet_generation.run_generation_fleet(
                    base, kafka, workdir, typer.echo, generation, duration_scale, repeats, rate, balances
                )
        return figures

    figures = asyncio.run(main())
    if "fleet" in figures:
        for line in fleet_table(figures["fleet"]):
            typer.echo(line)
    if "generation_fleet" in figures:
        typer.echo(f"generation: SmolLM2, {figures['rate']:g} req/s to the pair, each consumer pinned to a core")
        for line in fleet_generation.generation_table(figures["generation_fleet"]):
            typer.echo(line)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(figures, indent=2))
        typer.echo(f"wrote {json_out}")


@bench_app.command("share-partition")
def bench_share_partition(
    members: str = typer.Option("1,2,4,8", "--members", help="Comma-separated share member counts, one trial each."),
    poll_records: str = typer.Option("8,32", "--poll-records", help="Comma-separated poll sizes (max.poll.records)."),
    records: int = typer.Option(20000, "--records", help="Requests on the partition per trial."),
    bootstrap: str | None = typer.Option(None, "--bootstrap", help="Use this broker instead of starting a local one."),
) -> None:
    """What one request partition carries for a share group here: records handed out and acknowledged
    per second by N members polling it (no model runs: the broker's and the client's share)."""
    import logging
    import tempfile

    from pipeline.tools.bench.pipeline.run import bench_broker
    from pipeline.tools.bench.share_partition import run_partition_bench

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        counts = tuple(int(n) for n in members.split(","))
        sizes = tuple(int(n) for n in poll_records.split(","))
    except ValueError:
        typer.echo("error: --members and --poll-records take comma-separated whole numbers", err=True)
        raise typer.Exit(2) from None

    async def main() -> None:
        workdir = Path(tempfile.mkdtemp(prefix="batchtide-share-partition-"))
        async with bench_broker(bootstrap, workdir, typer.echo) as kafka:
            await run_partition_bench(kafka, counts, sizes, records, typer.echo)

    asyncio.run(main())


def parse_slowdown(text: str) -> tuple[float, float, float]:
    """FROM:TO:FACTOR (seconds into the load, and the multiplier), or a usage error."""
    try:
        start, end, factor = (float(part) for part in text.split(":"))
    except ValueError:
        typer.echo(f"error: --slowdown takes FROM:TO:FACTOR, e.g. 30:90:3 (got {text!r})", err=True)
        raise typer.Exit(2) from None
    if not 0 <= start < end or factor <= 0:
        typer.echo(f"error: --slowdown needs 0 <= FROM < TO and FACTOR > 0 (got {text!r})", err=True)
        raise typer.Exit(2)
    return start, end, factor


@bench_app.command("generation")
def bench_generation(
    scenario_opts: list[Path] = typer.Option(
        [], "--scenario", "-s", help="Generation scenario TOML (scenarios/generation/); repeat for several."
    ),
    trace: Path | None = typer.Option(
        None,
        "--trace",
        help="LLM request trace CSV (as `produce --trace`), instead of scenarios: the device, objectives and "
        "time scale are chosen unless given.",
    ),
    time_scale: float | None = typer.Option(
        None, "--time-scale", help="--trace: multiply arrival times (default: searched, printed)."
    ),
    length_scale: float = typer.Option(1.0, "--length-scale", help="--trace: multiply prompt and answer tokens."),
    answer_scale: float | None = typer.Option(
        None, "--answer-scale", help="--trace: multiply answer tokens by this instead of --length-scale."
    ),
    start: float = typer.Option(0.0, "--start", help="--trace: window start, seconds of the trace's own time."),
    window: float | None = typer.Option(
        None, "--window", help="--trace: window length, seconds of the trace's own time (default: to the end)."
    ),
    profile: Path | None = typer.Option(
        None,
        "--profile",
        help="--trace: the device's generation profile (default: this machine's cached SmolLM2 profile, else "
        "the generation scenarios' curve).",
    ),
    ttft_ms: float | None = typer.Option(None, "--ttft-ms", help="--trace: TTFT objective (default: from the device)."),
    tpot_ms: float | None = typer.Option(None, "--tpot-ms", help="--trace: TPOT objective (default: from the device)."),
    config: Path | None = typer.Option(
        None, "--config", help="--trace with --model: also simulate that model as configured (needs --profile)."
    ),
    model: str | None = typer.Option(None, "--model", help="--trace: the configured model to simulate as well."),
    quick: bool = typer.Option(False, "--quick", help="Coarser peer grids."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the reports as JSON here."),
    peer_kernels: str = typer.Option(
        "runner",
        "--peer-kernels",
        help="What the peers' iterations cost: runner (the runner's measured kernels, as "
        "batchtide's loop) or ragged (the servers' own idealised kernels).",
    ),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Processes the peers' grid runs are spread over."),
    peers: str = typer.Option(
        "",
        "--peers",
        help="Only these peer families, comma-separated (vllm, tgi, sglang, fixed-window): one bench split "
        "over several runs; default all.",
    ),
    give_up: str = typer.Option(
        "on",
        "--give-up",
        help="batchtide-default with the early give-up (a waiting request whose first token cannot meet the "
        "TTFT objective answered expired at once) on, off, or both (two rows).",
    ),
) -> None:
    """Goodput (requests/s meeting both the TTFT and the TPOT objective), p99 TTFT and TPOT of
    batchtide-default (untuned) and of vLLM's, TGI's, SGLang's and the fixed window's scheduler,
    each at its best configuration of its grid, on the same simulated device."""
    from pipeline.core.sim.generation.gen_scenario import load_gen_scenario
    from pipeline.core.sim.generation.peer_schedulers import KERNELS
    from pipeline.core.sim.scenario import ScenarioError
    from pipeline.tools.bench.generation import PEER_FAMILIES, bench_scenario
    from pipeline.tools.commands.literal_choice import pick

    give_ups = GIVE_UP.get(give_up)
    if give_ups is None:
        wide_console.print(f"[red]error:[/red] --give-up must be on, off or both (got {escape(give_up)})")
        raise typer.Exit(2)
    kernels = pick(peer_kernels, KERNELS)
    if kernels is None:
        wide_console.print(f"[red]error:[/red] --peer-kernels must be runner or ragged (got {escape(peer_kernels)})")
        raise typer.Exit(2)
    families = tuple(name.strip() for name in peers.split(",") if name.strip())
    unknown = [name for name in families if name not in PEER_FAMILIES]
    if unknown:
        wide_console.print(
            f"[red]error:[/red] --peers: unknown {escape(', '.join(unknown))} (known: {', '.join(PEER_FAMILIES)})"
        )
        raise typer.Exit(2)
    if bool(scenario_opts) == (trace is not None):
        wide_console.print("[red]error:[/red] give --scenario FILE (one or more) or --trace FILE")
        raise typer.Exit(2)
    reports = []
    if trace is not None:
        report = _bench_trace(
            trace,
            (time_scale, length_scale, start, window, answer_scale),
            profile,
            (ttft_ms, tpot_ms),
            (config, model),
            quick,
            peer_kernels,
            jobs,
            families,
            give_ups,
        )
        reports.append(report)
        _generation_table(report, f"{trace.name}: {report['requests']} requests", peer_kernels)
    for path in scenario_opts:
        try:
            scn = load_gen_scenario(path)
        except ScenarioError as e:
            wide_console.print(f"[red]error:[/red] {escape(str(e))}")
            raise typer.Exit(2) from None
        with wide_console.status(f"{scn.name}: batchtide-default and the peers' grids ..."):
            report = bench_scenario(
                scn, quick=quick, peer_kernels=kernels, jobs=jobs, families=families, give_up=give_ups
            )
        reports.append(report)
        _generation_table(report, f"{scn.name}: {report['requests']} requests", peer_kernels)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(reports, indent=2))
        wide_console.print(f"wrote {json_out}")


@bench_app.command("synth-trace")
def bench_synth_trace(
    shape: str = typer.Argument(
        ..., help="conversation, summarization or bursty (pipeline/core/sim/generation/synth_trace.py)."
    ),
    out: Path = typer.Option(..., "--out", help="The trace file to write (the common format of `produce --trace`)."),
    requests: int = typer.Option(3000, "--requests", min=2, help="Requests in the trace."),
    seed: int = typer.Option(0, "--seed", help="Random seed (the same shape, size and seed give the same file)."),
) -> None:
    """Write a synthetic LLM request trace of another workload's shape, for `bench generation --trace`."""
    from pipeline.core.sim.generation.synth_trace import synth_trace
    from pipeline.core.sim.generation.trace import write_trace

    try:
        made = synth_trace(shape, requests, seed)
    except ValueError as e:
        wide_console.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    write_trace(out, made.offset_s, made.prompt, made.answer)
    wide_console.print(
        f"wrote {escape(str(out))}: {requests} requests over {made.offset_s[-1]:,.0f} s, prompt tokens p50 "
        f"{sorted(made.prompt.tolist())[requests // 2]}, answer tokens p50 {sorted(made.answer.tolist())[requests // 2]}"
    )


def _bench_trace(
    trace: Path,
    scales: tuple[float | None, float, float, float | None, float | None],
    profile: Path | None,
    objectives: tuple[float | None, float | None],
    configured: tuple[Path | None, str | None],
    quick: bool,
    peer_kernels: str,
    jobs: int = 1,
    families: tuple[str, ...] = (),
    give_up: tuple[bool, ...] = (True,),
) -> dict[str, Any]:
    """`bench generation --trace`: the device found, the time scale searched when not given, the report."""
    from pipeline.core.config import ConfigError, ModelConfig, load_config
    from pipeline.core.profile_file import ProfileError, profile_path
    from pipeline.core.sim.generation.trace import TraceError, TraceSlice
    from pipeline.tools.bench.generation_trace import bench_trace, find_device
    from pipeline.tools.commands.demo import PROFILE_CACHE, SMOLLM
    from pipeline.tools.devtools.demo_plan import cache_key, machine_fingerprint

    time_scale, length_scale, start, window, answer_scale = scales
    config, model_name = configured
    spec = None
    try:
        if model_name is not None:
            spec = load_config(config).model(model_name)
        part = TraceSlice(time_scale or 1.0, length_scale, start, window, answer_scale)
        demo = ModelConfig(
            name=SMOLLM.name,
            runner="transformers",
            model_path=str(SMOLLM.keys["model_path"]),
            task="generate",
            max_new_tokens=SMOLLM.max_new_tokens,
            torch_threads=1,
        )
        cached = [PROFILE_CACHE.expanduser() / f"{cache_key(demo, machine_fingerprint())}.json", profile_path("smollm")]
        device = find_device(profile, cached)
        wide_console.print(f"device: {escape(device.source)}")
        report = bench_trace(
            trace,
            part,
            device,
            objectives[0],
            objectives[1],
            quick=quick,
            search=time_scale is None,
            model=spec,
            say=lambda line: wide_console.print(escape(line)),
            peer_kernels=peer_kernels,  # type: ignore[arg-type]
            jobs=jobs,
            families=families,
            give_up=give_up,
        )
    except (TraceError, ProfileError, ConfigError) as e:
        wide_console.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    wide_console.print(
        f"{escape(trace.name)}: {report['requests']} requests (trace rows {report['trace_indices'][0]}.."
        f"{report['trace_indices'][1]}), time x{report['time_scale']:.3g}"
        + (" (searched)" if report["time_scale_searched"] else "")
        + f", lengths x{length_scale:g}"
        + ("" if answer_scale is None else f", answers x{answer_scale:g}")
        + f": {report['offered_rps']:.3f} req/s offered; prompt tokens p50 "
        f"{report['prompt_tokens_p50']:.0f}, answer tokens p50 {report['answer_tokens_p50']:.0f}"
    )
    return report


GIVE_UP = {"on": (True,), "off": (False,), "both": (True, False)}
"""`bench generation --give-up`: the batchtide-default rows to run, the early give-up on or off."""


def _generation_table(report: dict[str, Any], title: str, peer_kernels: str) -> None:
    table = Table(
        title=f"{title}; objectives TTFT <= {report['ttft_ms']:,.0f} ms, TPOT <= {report['tpot_ms']:,.1f} ms; "
        f"peers on {peer_kernels} kernels"
    )
    for column in (
        "system",
        "goodput req/s",
        "req/s",
        "gen tok/s",
        "met both",
        "TTFT p99 ms",
        "TPOT p99 ms",
        "e2e p99 ms",
        "expired",
        "TTFT late",
        "given up",
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
            f"{row['generated_tokens_per_s']:.1f}",
            f"{row['attained']:.1%}",
            _ms(row["ttft_p99_ms"]),
            _ms(row["tpot_p99_ms"], 1),
            _ms(row["e2e_p99_ms"]),
            f"{row['expired_share']:.1%}",
            str(row["ttft_late"]),
            str(row["given_up"]),
            _ms(row["longest_gap_ms"]),
            str(row["runs"]),
            row["config"],
        )
    print_table(wide_console, table)
    wide_console.print(
        "  TTFT misses: TTFT late (answered, first token past the objective) + given up (answered expired)"
    )
    wide_console.print(f"  batchtide-default / best peer goodput: {report['default_vs_best_peer']:.2f}")


def _ms(value: float, digits: int = 0) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.add_typer(bench_app, name="bench")
