"""CLI command: `batchtide replay` (recorded traffic through the simulator, per candidate profile)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

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


def _request_table(result, model: str, since: str, ran) -> None:  # type: ignore[no-untyped-def]
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


def _generation_table(result, model: str, since: str, ran) -> None:  # type: ignore[no-untyped-def]
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


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("replay")(replay_command)
