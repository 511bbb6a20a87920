"""CLI commands: `consume` (a GPU consumer), `produce` (open-loop load), `results` (answers, one line each)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from pipeline.core.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from pipeline.tools.devtools.producer import Load

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
            + (
                f" share: accepted={s.share_accepted} released={s.share_released} rejected={s.share_rejected} "
                f"redelivered={s.share_redelivered} late_acks={s.share_late_acks} "
                f"released_excess={s.share_released_excess}"
                if c.share
                else ""
            )
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
    trace: Path | None = typer.Option(
        None,
        "--trace",
        help="Trace CSV (timestamp,prompt_tokens,answer_tokens; or the Azure LLM trace header): replay its "
        "arrivals with prompts of its exact token counts (the model's tokenizer) and answers forced to its lengths.",
    ),
    time_scale: float = typer.Option(1.0, "--time-scale", help="--trace: multiply arrival times (2 = half the rate)."),
    length_scale: float = typer.Option(1.0, "--length-scale", help="--trace: multiply prompt and answer tokens."),
    answer_scale: float | None = typer.Option(
        None, "--answer-scale", help="--trace: multiply answer tokens by this instead of --length-scale."
    ),
    start: float = typer.Option(0.0, "--start", help="--trace: window start, seconds of the trace's own time."),
    window: float | None = typer.Option(
        None, "--window", help="--trace: window length, seconds of the trace's own time (default: to the end)."
    ),
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
    if sum(x is not None for x in (scenario, rate, trace)) != 1:
        typer.echo("error: give exactly one of --scenario FILE, --rate R and --trace FILE", err=True)
        raise typer.Exit(2)
    partitions = cfg.models[model].partitions if model in cfg.models else 4
    if scenario is not None:
        load = scenario_load(str(scenario), multiplier, partitions)
    elif trace is not None:
        load = _trace_load(cfg, model, trace, (time_scale, length_scale, start, window, answer_scale), seed)
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


def _trace_load(
    cfg: Config, model: str, path: Path, scales: tuple[float, float, float, float | None, float | None], seed: int
) -> Load:
    """The trace's slice as a load for `model`: prompts built to the exact token counts as its runner
    counts them (its tokenizer), every request checked as its consumer would check it (a request it
    would refuse is an error here, with what to change)."""
    import numpy as np

    from consumers.runners import make_runner
    from pipeline.core.sim.generation.trace import TraceError, TraceSlice, read_trace
    from pipeline.tools.devtools.trace_load import PromptError, exact_prompts, trace_load
    from schemas.messages import MAX_NEW_TOKENS, GenerationParams, Request

    if model not in cfg.models:
        typer.echo(f"error: --trace needs model {model!r} in the config (its tokenizer and limits)", err=True)
        raise typer.Exit(2)
    spec = cfg.model(model)
    time_scale, length_scale, start, window, answer_scale = scales
    try:
        part = TraceSlice(time_scale, length_scale, start, window, answer_scale)
        sliced = part.apply(read_trace(path))
    except TraceError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    runner = make_runner(spec, weights=False)
    runner.load()

    def count(text: str) -> int:
        return runner.measure(Request(id="trace-prompt", model=model, text=text))[0]

    try:
        texts = exact_prompts(sliced.prompt.tolist(), count, seed)
    except PromptError as e:
        typer.echo(f"error: {path}: {e}", err=True)
        raise typer.Exit(2) from None
    load = trace_load(sliced, texts)
    refused = []
    for i, (text, answer) in enumerate(zip(texts, sliced.answer.tolist(), strict=True)):
        params = GenerationParams(max_new_tokens=min(int(answer), MAX_NEW_TOKENS), ignore_eos=True)
        why = (
            f"answer of {answer} tokens is over the wire's limit {MAX_NEW_TOKENS}"
            if answer > MAX_NEW_TOKENS
            else runner.check(Request(id=f"trace-{i}", model=model, text=text, params=params))
        )
        if why is not None:
            refused.append((int(sliced.index[i]), why))
    runner.close()
    if refused:
        index, why = refused[0]
        typer.echo(
            f"error: model {model!r} would refuse {len(refused)} of the {len(load)} requests of the slice (the first, "
            f"trace index {index}: {why}); lower --length-scale or raise the model's max_input_tokens / max_new_tokens",
            err=True,
        )
        raise typer.Exit(2)
    typer.echo(
        f"trace {path}: {len(load)} requests, {part.describe()}: {sliced.rate_per_s:.2f} req/s over "
        f"{sliced.span_s:.0f} s; prompt tokens p50 {np.median(sliced.prompt):.0f} max {sliced.prompt.max()}, answer "
        f"tokens p50 {np.median(sliced.answer):.0f} max {sliced.answer.max()} (forced: ignore_eos)"
    )
    return load


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
    (start of generated text, embedding dimension and norm, or the reason of an error/rejection).
    An id answered again (share mode is at-least-once) is shown once: the first answer."""
    import time

    from pipeline.core.kafka.client import Topics, list_topics
    from pipeline.core.kafka.first_answers import FirstAnswers
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
        first = FirstAnswers()

        def show(record: Record) -> None:
            nonlocal shown
            answer = Answer.decode(record.value, record.timestamp)
            if wanted and answer.id not in wanted:
                return
            if answer.id is not None and not first.first(answer.id, record.timestamp):
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


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("consume")(consume)
    app.command("produce")(produce)
    app.command("results")(results)
