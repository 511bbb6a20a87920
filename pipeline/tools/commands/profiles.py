"""CLI commands about a model's profile: `batchtide profile` measures a model on this device and writes its
profile file; `batchtide replay` runs recorded traffic through the simulator under the profile that ran and
under candidate profiles."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from consumers.runners.profile import Point
    from pipeline.core.config import BatchProfile
    from pipeline.tools.bench.replay import Replay

console = Console()


def replay_command(
    since: str = typer.Option("1h", "--since", help="Window ending now: 30s, 15m, 1h, 1d..."),
    config: Path | None = typer.Option(None, "--config", help="batchtide TOML config (the profile that ran)."),
    model: str | None = typer.Option(None, "--model", help="Model to replay (default: the config's only model)."),
    profile: Path | None = typer.Option(
        None, "--profile", help="Device profile JSON the consumer loaded (memory limit, prefilled t(b))."
    ),
    export: Path | None = typer.Option(None, "--export", help="Write the window as a scenario TOML here."),
    validate: bool = typer.Option(
        False,
        "--validate",
        help="Exit 1 unless the prediction for the profile that ran is within 15% of the recording.",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the predictions as JSON here."),
    replays: int = typer.Option(
        9,
        "--replays",
        min=1,
        help="Replays per candidate, each drawing the recorded device's speed and gaps with its own seed; "
        "the figures are their medians.",
    ),
    calibrate: bool = typer.Option(
        True,
        "--calibrate/--no-calibrate",
        help="Generation: scale the profile's prefill and decode-step curves to the time per output token "
        "the window recorded (the device's speed while it ran); off uses the profile as measured.",
    ),
) -> None:
    """Replay the recorded arrivals of a window under the profile that ran and a grid of
    candidates: predicted p50/p99/p999, throughput, hit ratio, expired share, and the
    recommended profile. A generating model with iteration-level batching is replayed through
    the decode loop (prefills and decode steps of a running set, from its profile's curves)."""
    from pipeline.core.config import ConfigError, load_config
    from pipeline.core.profile_file import ProfileError, load_profile
    from pipeline.core.store.connection import ClickHouseUnavailable, connect
    from pipeline.core.store.traffic import read_traffic
    from pipeline.tools.bench.replay import ReplayError, replay, scenario_toml
    from pipeline.tools.views.report import parse_duration_ms

    try:
        cfg = load_config(config)
        span = parse_duration_ms(since)
        device = load_profile(profile) if profile is not None else None
    except (ConfigError, ProfileError, ValueError) as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    if model is None:
        if len(cfg.models) != 1:
            known = ", ".join(sorted(cfg.models)) or "none"
            console.print(f"[red]error:[/red] say which model with --model (configured: {known})")
            raise typer.Exit(2)
        model = next(iter(cfg.models))
    ran = cfg.model(model).profile if model in cfg.models else cfg.defaults
    now = int(time.time() * 1000)
    try:
        client = connect(cfg.clickhouse, database=cfg.clickhouse.database)
    except ClickHouseUnavailable as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    try:
        traffic = read_traffic(client, cfg.clickhouse.database, model, now - span, now)
    finally:
        client.close()
    spec = cfg.models.get(model)
    generation = traffic.generating and spec is not None and spec.batching == "iteration"
    try:
        if generation:
            from pipeline.core.profile_file import profile_path
            from pipeline.tools.bench.replay_generation import GenSetup, replay_generation

            if device is None and profile_path(model).is_file():
                device = load_profile(profile_path(model))
            if device is None:
                raise ReplayError(
                    f"replaying generation needs the model's profile file: pass --profile (or write "
                    f"{profile_path(model)} with `batchtide profile --model {model}`)"
                )
            assert spec is not None  # `generation` says so
            result = replay_generation(traffic, ran, GenSetup(spec, device), calibrate=calibrate)
        else:
            result = replay(
                traffic,
                ran,
                device_cap=device.memory_limit if device else None,
                prior_costs=device.cost_points() if device else None,
                replays=replays,
            )
    except (ReplayError, ProfileError) as e:
        console.print(f"[red]nothing to replay:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None

    rec = result.recorded
    if generation:
        _generation_table(result, model, since, ran)
    else:
        _request_table(result, model, since, ran)
    best = result.recommended()
    changes = {k: v for k, v in vars(best.profile).items() if getattr(ran, k) != v}
    console.print(f"recommended: {best.name}" + (f" — set {changes}" if changes else " — keep the profile that ran"))
    check = result.validation()
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(
            json.dumps(
                {
                    "model": model,
                    "since": since,
                    "recorded": vars(rec),
                    "validation": check,
                    "recommended": best.name,
                    "generation": generation,
                    "parts": list(result.parts),
                    "replays": result.replays,
                    "predictions": [
                        {**{k: v for k, v in vars(p).items() if k != "profile"}, "profile": vars(p.profile)}
                        for p in result.predictions
                    ],
                },
                indent=2,
                default=str,
            )
        )
        console.print(f"wrote {json_out}")
    if export:
        if result.scenario is None:
            console.print("[yellow]--export: a generating model's window cannot be exported as a scenario yet[/yellow]")
        else:
            export.parent.mkdir(parents=True, exist_ok=True)
            export.write_text(scenario_toml(result))
            console.print(f"wrote {export}")
    if validate:
        verdict = "agree" if result.validates() else "DISAGREE"
        if not generation:
            added = ", ".join(result.parts) or "none (recorded times per size in order, median hops)"
            console.print(f"replayed {result.replays}x per candidate; added from the recording: {added}")
        console.print(
            f"validate: predicted/recorded p99 {check['p99_ratio']:.2f}, "
            f"throughput {check['throughput_ratio']:.2f} (within 15%: {verdict})"
        )
        if not result.validates():
            raise typer.Exit(1)


def _request_table(result: Replay, model: str, since: str, ran: BatchProfile) -> None:
    from pipeline.tools.views.tables import print_table

    rec = result.recorded
    hops = (
        "start and publish gaps per batch"
        if "start gap" in result.parts
        else f"hops outside the device {rec.overhead_ms:.1f} ms added"
    )
    table = Table(
        title=f"replay of {model}: {rec.requests} recorded requests over the last {since} "
        f"(SLO p99 {ran.slo_p99_ms:g} ms; {hops}; median of {result.replays} replays)"
    )
    for column in (
        "candidate",
        "hard_cap",
        "target",
        "max_wait",
        "mark",
        "p50 ms",
        "p99 ms",
        "p999 ms",
        "req/s",
        "hit ratio",
        "expired",
        "marked",
        "mean batch",
    ):
        table.add_column(column, justify="left" if column == "candidate" else "right")
    best = result.recommended()
    for p in result.predictions:
        prof = p.profile
        name = f"[bold]{p.name}[/bold] (recommended)" if p is best else p.name
        table.add_row(
            name,
            str(prof.hard_cap),
            str(prof.target_size),
            f"{prof.max_wait_ms:g}",
            "off" if not prof.tail_marking else f"{prof.tail_mark_ratio:g}x q{prof.tail_mark_quantile:g}",
            f"{p.p50_ms:.1f}",
            f"{p.p99_ms:.1f}",
            f"{p.p999_ms:.1f}",
            f"{p.throughput_rps:.1f}",
            f"{p.hit_ratio:.2f}",
            f"{p.expired_share:.2%}",
            f"{p.marked_share:.2%}",
            f"{p.mean_batch:.1f}",
        )
    table.add_row(
        "[italic]recorded[/italic]",
        "",
        "",
        "",
        "",
        f"{rec.p50_ms:.1f}",
        f"{rec.p99_ms:.1f}",
        f"{rec.p999_ms:.1f}",
        f"{rec.throughput_rps:.1f}",
        "",
        "",
        f"{rec.marked_share:.2%}",
        "",
    )
    print_table(console, table)


def _generation_table(result: Replay, model: str, since: str, ran: BatchProfile) -> None:
    from pipeline.tools.views.tables import print_table

    rec = result.recorded
    scale = rec.device_scale
    speed = "as profiled" if scale is None or scale == 1.0 else f"device {scale:.2f}x its profiled step times"
    if rec.step_overhead_ms:
        speed += f" + {rec.step_overhead_ms:.0f} ms per step"
    if rec.ride_ms_per_token:
        speed += f"; joiners admitted at {rec.join_pace_rps:.2f} req/s: {rec.ride_ms_per_token:.2f} ms per ridden token"
    table = Table(
        title=f"generation replay of {model}: {rec.requests} recorded requests over the last {since} "
        f"(SLO p99 {ran.slo_p99_ms:g} ms; {speed}; hops after the last token {rec.overhead_ms:.1f} ms added)"
    )
    for column in (
        "candidate",
        "inflight",
        "p50 ms",
        "p99 ms",
        "req/s",
        "TTFT p99",
        "TPOT p99",
        "expired",
        "mean rows",
        "mean batch",
    ):
        table.add_column(column, justify="left" if column == "candidate" else "right")
    best = result.recommended()
    for p in result.predictions:
        name = f"[bold]{p.name}[/bold] (recommended)" if p is best else p.name
        table.add_row(
            name,
            str(p.profile.max_inflight_batches),
            f"{p.p50_ms:.1f}",
            f"{p.p99_ms:.1f}",
            f"{p.throughput_rps:.2f}",
            f"{p.ttft_p99_ms:.1f}",
            f"{p.tpot_p99_ms:.1f}",
            f"{p.expired_share:.2%}",
            f"{p.mean_rows:.1f}",
            f"{p.mean_batch:.1f}",
        )
    table.add_row(
        "[italic]recorded[/italic]",
        "",
        f"{rec.p50_ms:.1f}",
        f"{rec.p99_ms:.1f}",
        f"{rec.throughput_rps:.2f}",
        f"{rec.ttft_p99_ms:.1f}",
        f"{rec.tpot_p99_ms:.1f}",
        "",
        "",
        "",
    )
    print_table(console, table)


def profile(
    model: str = typer.Option(
        ...,
        "--model",
        help="A model name of the config (its \\[models.NAME] table), or a model_path (directory or wheel) without --config.",
    ),
    config: Path | None = typer.Option(None, "--config", help="TOML config file to take the model from."),
    out: Path | None = typer.Option(
        None, "--out", help="Profile file to write (default var/profiles/<model>.json, what `consume` loads)."
    ),
    tokens: int = typer.Option(
        32,
        "--tokens",
        help="Input (prompt) tokens per request (generation: besides, one request at the longest prompt the model admits is measured).",
    ),
    max_size: int = typer.Option(256, "--max-size", help="Largest batch size tried (requests)."),
    budget_ms: float | None = typer.Option(
        None,
        "--budget-ms",
        help="Stop past this batch time (a decode step, for generation); default: the profile's compute budget, else slo_p99_ms / 2.",
    ),
    headroom: float = typer.Option(
        0.2, "--headroom", help="Share of device memory kept free (CPU: of the memory available at start)."
    ),
    seconds: float = typer.Option(1.0, "--seconds", help="Timing budget per size (embeddings; at least 3 runs)."),
    decode_steps: int = typer.Option(16, "--decode-steps", help="Generation: decode steps timed per batch size."),
) -> None:
    """Measure t(b), throughput and peak memory at doubling batch sizes on the real device; print the
    knee, the memory limit and the recommended profile; write the profile file."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from consumers.runners import make_runner, measured_profile
    from consumers.runners import profile as measure
    from pipeline.core import profile_file
    from pipeline.core.config import ConfigError, ModelConfig, load_config

    console = Console()
    try:
        spec = (
            load_config(config).model(model)
            if config
            else ModelConfig(name=Path(model).name.replace("_", "-") or "model", model_path=model)
        )
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if max_size < 1 or tokens < 1 or not 0 <= headroom < 1:
        typer.echo("error: --max-size and --tokens must be >= 1, --headroom in [0, 1)", err=True)
        raise typer.Exit(2)
    spec = dataclasses.replace(spec, isolation="thread", batching="static")
    budget = budget_ms or spec.profile.compute_budget_ms or spec.profile.slo_p99_ms / 2.0
    runner = make_runner(spec)
    with console.status(f"loading {spec.name} ({spec.model_path}) ..."):
        runner.load()
    device = getattr(runner, "device", None) or "cpu"
    generate = getattr(runner, "task", None) == "generate"
    steps = len(measure.sizes_up_to(max_size))
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} sizes"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(f"profiling {spec.name} on {device}", total=steps)

        def advance(text: str) -> None:
            progress.update(task, advance=1, description=f"profiling {spec.name} on {device}: {text}")

        if generate:
            found = measure.measure_generation(
                runner,
                device=device,
                tokens=tokens,
                max_size=max_size,
                budget_ms=budget,
                headroom=headroom,
                on_point=advance,
                decode_steps=decode_steps,
            )
        else:
            found = measure.measure_batches(
                runner,
                device=device,
                tokens=tokens,
                max_size=max_size,
                budget_ms=budget,
                headroom=headroom,
                on_point=advance,
                seconds=seconds,
            )
        progress.update(task, completed=steps)
    runner.close()
    data = measured_profile.build(found, spec, simulated=runner.simulated)
    machine = measure.machine_info()
    kind = "SIMULATED runner" if runner.simulated else "real model"
    console.print(
        f"{spec.name} ({spec.model_path}, {kind}) on {device}; {machine['cpus']} CPUs, load average {machine['load_avg']}"
    )
    if machine["load_avg"] > machine["cpus"] * 0.75:
        console.print("[yellow]the machine is busy: times include waiting for a CPU[/yellow]")
    console.print(
        _table(
            Table, "prefill" if generate else "batches", found.prefill if generate else found.points, generate, "prompt"
        )
    )
    if generate:
        console.print(
            _table(Table, f"decode step (cache ~{tokens}+{decode_steps // 2} tokens)", found.points, generate, "decode")
        )
    memory = data["memory"]
    limit_units = memory["limit_units"]
    unit = data["unit"]
    console.print(
        f"stopped: {found.stop_reason} (budget {budget:.0f} ms{' per decode step' if generate else ''}); knee b={data['knee']}; "
        f"memory limit {memory['limit_bytes'] / 2**20:,.0f} MiB ({memory['kind']}), "
        + (
            f"~{limit_units:,} {unit} at {memory['bytes_per_unit']:,.0f} B each"
            if limit_units
            else "per-unit growth not measurable"
        )
    )
    if generate:
        console.print(_longest_line(data, spec.max_new_tokens))
    rec = data["recommended"]
    console.print(
        "recommended profile: "
        + ", ".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in rec.items())
    )
    target = out or profile_file.profile_path(spec.name)
    profile_file.write(data, target)
    console.print(f"wrote {target} (`batchtide consume --model {spec.name}` loads it at start)")


def _longest_line(data: dict[str, Any], max_new_tokens: int) -> str:
    """What the longest request the model admits costs, or why the device cannot hold it."""
    longest = data["longest"]
    tokens = longest["prompt_tokens"] + max_new_tokens
    if longest["prefill"] is None:
        return (
            f"[red]the longest request the model admits ({longest['prompt_tokens']} + {max_new_tokens} tokens) ran out of "
            "memory: lower max_input_tokens or max_new_tokens[/red]"
        )
    line = (
        f"longest admissible request: prompt {longest['prompt_tokens']} + max_new_tokens {max_new_tokens} = {tokens} tokens; "
        f"prefill {longest['prefill']['median_ms']:.0f} ms, decode step {longest['step']['median_ms']:.1f} ms"
    )
    limit = data["memory"]["limit_units"]
    if limit and tokens > limit:
        line += f" [red](over the memory limit of ~{limit:,} tokens: lower max_input_tokens or max_new_tokens)[/red]"
    return line


def _table(table_cls: type[Table], title: str, points: list[Point], generate: bool, kind: str) -> Table:
    table = table_cls(title=title)
    rate = "gen tok/s" if kind == "decode" else ("prompt tok/s" if generate else "tokens/s")
    for column in ("batch", "tokens", "median ms", "p90 ms", "items/s", rate, "peak MiB", "runs"):
        table.add_column(column, justify="right")
    for p in points:
        table.add_row(
            str(p.size),
            str(p.tokens),
            f"{p.median_ms:.1f}",
            f"{p.p90_ms:.1f}",
            f"{p.items_per_s:.1f}",
            f"{p.tokens_per_s:.0f}",
            f"{p.peak_bytes / 2**20:.1f}",
            str(p.runs),
        )
    return table


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("replay")(replay_command)
    app.command("profile")(profile)
