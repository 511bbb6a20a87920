"""CLI commands: `consume` (a GPU consumer), `produce` (open-loop load), `results` (answers, one line each),
and `bench pipeline` and `bench fleet-live` (the real end-to-end benches, attached to the bench group)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import typer

from pipeline.core.config import Config, ConfigError, load_config

RESULTS_READ_TIMEOUT_S = 3600.0
"""`results` without --follow stops at the end offsets it found; this only bounds a broker that never gets there."""


def _config(path: Path | None) -> Config:
    try:
        return load_config(path)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _stop_on_signals(stop: asyncio.Event) -> None:
    """The first SIGINT/SIGTERM stops cleanly (a consumer finishes, commits and closes
    within `[consumer] stop_timeout_s`, broker or not); a second one exits at once, and
    a consumer group gets what was not committed again."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            typer.echo(f"second {sig.name}: exiting now, without a clean stop", err=True)
            os._exit(128 + sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)


def consume(
    model: str = typer.Option(..., "--model", help="Model to serve (a \\[models.NAME] table of the config)."),
    config: Path | None = typer.Option(None, "--config", help="TOML config file."),
    consumer_id: str | None = typer.Option(
        None, "--consumer-id", help="Name in events and results (default host-pid-model)."
    ),
    create_topics: bool = typer.Option(True, help="Create the model's topics if missing."),
) -> None:
    """Serve one model: join its consumer group, batch, run, answer. SIGTERM/SIGINT stop cleanly."""
    import logging

    from consumers.serving import serve
    from consumers.worker import Consumer

    cfg = _config(config)
    try:
        cfg.model(model)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The lag recorder assigns its probe to each lagging partition every sample, and aiokafka
    # logs every assignment; the consumer logs its own group assignment itself.
    logging.getLogger("aiokafka.consumer.subscription_state").setLevel(logging.WARNING)

    def show(c: Consumer) -> None:
        s = c.stats
        typer.echo(
            f"[{c.consumer_id}] fetched={s.fetched} ok={s.answered['ok']} expired={s.answered['expired']} "
            f"error={s.answered['error']} rejected={s.answered['rejected']} dlq={s.dead_letters} "
            f"batches={s.batches} forwarded={s.forwarded} queue={s.queue} backlog={s.backlog} pauses={s.pauses} "
            f"stalls_unblocked={s.fetch_stalls_unblocked} self_fenced={s.transactions_self_fenced} "
            f"txn_refused={s.txn_offsets_refused} "
            f"inherited={s.answered_inherited} unstable_waits={s.unstable_offsets_waited}"
        )

    async def main() -> None:
        stop = asyncio.Event()
        _stop_on_signals(stop)
        consumer = await serve(cfg, model, stop, consumer_id=consumer_id, create_topics=create_topics, on_stats=show)
        show(consumer)

    asyncio.run(main())


def produce(
    model: str = typer.Option("minilm", "--model", help="Model whose request topic receives the load."),
    scenario: Path | None = typer.Option(
        None, "--scenario", help="Scenario TOML: replay its arrival process in real time."
    ),
    rate: float | None = typer.Option(None, "--rate", help="Poisson rate (req/s), instead of a scenario."),
    duration: float = typer.Option(10.0, "--duration", help="Seconds of Poisson load (with --rate)."),
    multiplier: float = typer.Option(1.0, "--multiplier", help="Scale the scenario's rates."),
    tokens: int = typer.Option(24, "--tokens", help="Approximate tokens per request (with --rate)."),
    seed: int = typer.Option(1, "--seed"),
    config: Path | None = typer.Option(None, "--config", help="TOML config file (Kafka settings)."),
) -> None:
    """Open-loop load generator: sends at the scheduled times regardless of responses."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pipeline.core.kafka.client import ensure_topics
    from pipeline.tools.devtools.producer import LoadProducer, poisson_load, scenario_load

    cfg = _config(config)
    if (scenario is None) == (rate is None):
        typer.echo("error: give exactly one of --scenario FILE and --rate R", err=True)
        raise typer.Exit(2)
    partitions = cfg.models[model].partitions if model in cfg.models else 4
    if scenario is not None:
        load = scenario_load(str(scenario), multiplier, partitions)
    else:
        assert rate is not None
        load = poisson_load(rate, duration, seed, tokens=tokens)

    async def main() -> None:
        await ensure_topics(cfg.kafka, {model: partitions})
        columns = (TextColumn("sending"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns) as progress:
            task = progress.add_task("send", total=len(load))
            async with LoadProducer(cfg.kafka, model, seed=seed) as producer:
                report = await producer.send(load, lambda n: progress.update(task, completed=n))
        offered = len(load) / load.duration_s if load.duration_s else 0.0
        typer.echo(
            f"sent {report.sent} requests in {report.elapsed_s:.1f} s: achieved {report.achieved_rate:.1f} req/s "
            f"(offered {offered:.1f} req/s; p99 send lateness {report.late_ms_p99:.1f} ms)"
        )

    asyncio.run(main())


def results(
    model: str = typer.Option(..., "--model", help="Model whose result topic to read."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep waiting for new results (Ctrl-C stops)."),
    as_json: bool = typer.Option(False, "--json", help="Full result records as JSON lines (embeddings included)."),
    ids: list[str] | None = typer.Option(None, "--id", help="Only this request id (repeatable)."),
    since: str | None = typer.Option(
        None, "--since", help="Only results written after this: 15m, 2h ago, or an ISO time."
    ),
    from_beginning: bool = typer.Option(True, help="Start at the oldest result (--no-from-beginning: only new ones)."),
    config: Path | None = typer.Option(None, "--config", help="TOML config file (Kafka settings)."),
) -> None:
    """One line per answer: time, id, outcome, end-to-end ms, batch, consumer, and a preview
    (start of generated text, embedding dimension and norm, or the reason of an error/rejection)."""
    import time

    from pipeline.core.kafka.client import Topics, list_topics
    from pipeline.core.kafka.reader import Record, TopicReader
    from pipeline.tools.views.answer_lines import Answer
    from pipeline.tools.views.panel_data import parse_instant

    cfg = _config(config)
    topic = Topics(cfg.kafka.topic_prefix).results(model)
    wanted = set(ids or ())
    try:
        since_ms = parse_instant(since, int(time.time() * 1000)) if since else None
    except ValueError as e:
        typer.echo(f"error: --since: {e}", err=True)
        raise typer.Exit(2) from None

    async def main() -> int:
        stop = asyncio.Event()
        _stop_on_signals(stop)
        if not (await list_topics(cfg.kafka)).get(topic):
            typer.echo(
                f"error: topic {topic} does not exist (is model {model!r} configured and its topics created?)", err=True
            )
            return 1
        shown = 0

        def show(record: Record) -> None:
            nonlocal shown
            answer = Answer.decode(record.value, record.timestamp)
            if wanted and answer.id not in wanted:
                return
            typer.echo(answer.as_json() if as_json else answer.as_line())
            shown += 1

        async with TopicReader(cfg.kafka, topic, from_beginning=from_beginning, since_ms=since_ms) as reader:
            if follow:
                await reader.read(show, until=stop.is_set, poll_ms=500)
            else:
                await reader.read_to_end(show, timeout_s=RESULTS_READ_TIMEOUT_S)
        if wanted and not shown:
            typer.echo(f"no result for {', '.join(sorted(wanted))} on {topic}", err=True)
            return 1
        return 0

    code = asyncio.run(main())
    if code:
        raise typer.Exit(code)


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
    ttft_slo_ms: float = typer.Option(5000.0, "--ttft-slo-ms", help="smollm: TTFT objective of the goodput column."),
    tpot_slo_ms: float = typer.Option(500.0, "--tpot-slo-ms", help="smollm: TPOT objective of the goodput column."),
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
    from pipeline.tools.bench.pipeline.options import BenchOptions
    from pipeline.tools.bench.pipeline.run import run_bench

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # new topics log transient leader errors
    if runner not in ("minilm", "smollm", "zero-cost", "cost-model"):
        typer.echo(f"error: --runner must be minilm, smollm, zero-cost or cost-model (got {runner!r})", err=True)
        raise typer.Exit(2)
    if isolation not in ("auto", "process", "thread"):
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
    if not find_max and rates is None:
        typer.echo("error: give --find-max and/or --rates R1,R2,...", err=True)
        raise typer.Exit(2)
    try:
        offered = tuple(float(r) for r in rates.split(",")) if rates else ()
    except ValueError:
        typer.echo(f"error: --rates must be numbers separated by commas (got {rates!r})", err=True)
        raise typer.Exit(2) from None
    options = BenchOptions(
        runner=runner,  # type: ignore[arg-type]
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
        isolation=isolation,  # type: ignore[arg-type]
        llm_profile=str(llm_profile) if llm_profile else None,
        timeout_ms=timeout_ms,
        straggler=straggler,
        slowdown=window,
        ttft_slo_ms=ttft_slo_ms,
        tpot_slo_ms=tpot_slo_ms,
        record_dir=str(record) if record else None,
    )
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
    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    if runner == "smollm" and not set(mode_list) <= {"static", "iteration", "fixed"}:
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


def bench_fleet_live(
    cases: str | None = typer.Option(
        None, "--cases", help="Comma-separated case names (default: every case); their baselines run too."
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
        help="Run each case's off/on pair this many times (alternating, a new seed each) and report the median trial.",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write every row, with its whole trial, as JSON here."),
) -> None:
    """A consumer group with a slow member, on the real pipeline: each case with the group's balance
    off (Kafka's equal partition counts) and on, p99 against the all-fast group of the same run."""
    import logging
    import tempfile

    from pipeline.tools.bench.fleet_live import CASES, fleet_table, run_fleet
    from pipeline.tools.bench.pipeline.options import BenchOptions
    from pipeline.tools.bench.pipeline.run import bench_broker

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    names = tuple(c.strip() for c in cases.split(",") if c.strip()) if cases else ()
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        typer.echo(f"error: unknown case(s) {sorted(unknown)}; cases: {[c.name for c in CASES]}", err=True)
        raise typer.Exit(2)
    if duration_scale <= 0:
        typer.echo(f"error: --duration-scale must be > 0 (got {duration_scale})", err=True)
        raise typer.Exit(2)
    if repeats < 1:
        typer.echo(f"error: --repeats must be >= 1 (got {repeats})", err=True)
        raise typer.Exit(2)
    base = BenchOptions(seed=seed, bootstrap=bootstrap, partitions=partitions)

    async def main() -> dict[str, Any]:
        workdir = Path(tempfile.mkdtemp(prefix="batchtide-fleet-"))
        async with bench_broker(bootstrap, workdir, typer.echo) as kafka:
            return await run_fleet(base, kafka, workdir, typer.echo, names, duration_scale, repeats)

    figures = asyncio.run(main())
    for line in fleet_table(figures["fleet"]):
        typer.echo(line)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(figures, indent=2))
        typer.echo(f"wrote {json_out}")


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


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app, and `pipeline` to the bench group."""
    from pipeline.tools.commands.bench import bench_app

    app.command("consume")(consume)
    app.command("produce")(produce)
    app.command("results")(results)
    bench_app.command("pipeline")(bench_pipeline)
    bench_app.command("fleet-live")(bench_fleet_live)
