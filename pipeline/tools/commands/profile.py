"""CLI command: `batchtide profile` measures a model on this device and writes its profile file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer


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

        common = dict(
            device=device, tokens=tokens, max_size=max_size, budget_ms=budget, headroom=headroom, on_point=advance
        )
        if generate:
            found = measure.measure_generation(runner, decode_steps=decode_steps, **common)  # type: ignore[arg-type]
        else:
            found = measure.measure_batches(runner, seconds=seconds, **common)  # type: ignore[arg-type]
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


def _longest_line(data: dict, max_new_tokens: int) -> str:
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


def _table(table_cls: type, title: str, points: list, generate: bool, kind: str):  # type: ignore[no-untyped-def]
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
    app.command("profile")(profile)
