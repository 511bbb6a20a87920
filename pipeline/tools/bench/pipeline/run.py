"""The real pipeline bench: producer -> Kafka -> consumer process(es) -> results -> client.

Every figure is end to end on one clock: the client stamps a request when it
hands it to its producer and again when the result record arrives, so broker
time, fetch, batching, compute and the result's trip back all count. The
consumers run as separate processes (`batchtide consume`, exactly what a user
runs), so client and consumer never share an interpreter lock. Load is
open-loop Poisson (see `pipeline.tools.devtools.producer`).

Modes:
- find-max (zero-cost runner): ramp the offered rate until the pipeline stops
  keeping up; sustained = answered >= 95% of offered within the run and p99
  bounded. Then measure the added latency at half that rate.
- rates (a real model, e.g. MiniLM on one torch thread): p50/p99/p999,
  req/s and tokens/s at each offered rate.
- LLM (`--runner smollm`): the same rates for each batching mode (static
  micro-batching in tokens, iteration-level, the field report's fixed 20 ms /
  cap 48) and each length mix (`lengths`: max_new_tokens uniform
  8..128 or all equal, lognormal prompts and outputs, long prompts among
  short ones): generated tokens/s, p99, TTFT/TPOT and goodput, against the
  machine's limit computed from the model's profile (its measured prefill and
  decode-step curves; measured in the same run with --profile-in-run).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pipeline.core.config import KafkaSettings
from pipeline.core.sim.generation.trace import TraceSlice
from pipeline.tools.bench.pipeline.llm import llm_modes
from pipeline.tools.bench.pipeline.options import LLM_MODES, BenchOptions, LlmMode
from pipeline.tools.bench.pipeline.printout import describe
from pipeline.tools.bench.pipeline.record import replay_commands
from pipeline.tools.bench.pipeline.trace_replay import trace_live
from pipeline.tools.bench.pipeline.trial import Trial, run_trial


async def find_max(
    options: BenchOptions, kafka: KafkaSettings, workdir: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    """Ramp x1.5 until a rate is not sustained, bisect once between the last good and the first bad."""
    trials: list[Trial] = []
    best: Trial | None = None
    rate = options.find_max_start
    failed: float | None = None
    while rate <= options.find_max_limit:
        trial = await run_trial(options, kafka, rate, workdir, say)
        say(describe(trial))
        trials.append(trial)
        if not trial.sustained:
            failed = rate
            break
        best = trial
        rate *= 1.5
    if best is not None and failed is not None:
        middle = (best.offered_rps + failed) / 2
        trial = await run_trial(options, kafka, middle, workdir, say)
        say(describe(trial))
        trials.append(trial)
        if trial.sustained:
            best = trial
    out: dict[str, Any] = {"zero_cost_trials": [asdict(t) | {"sustained": t.sustained} for t in trials]}
    if best is None:
        out |= {"zero_cost_max_rps": 0.0}
        return out
    half = best.offered_rps / 2
    say(f"max sustained {best.offered_rps:.0f} req/s; added latency at half that ({half:.0f} req/s):")
    at_half = await run_trial(options, kafka, half, workdir, say)
    say(describe(at_half))
    return out | {
        "zero_cost_max_rps": best.offered_rps,
        "zero_cost_max_throughput_rps": best.throughput_rps,
        "zero_cost_half_rate_rps": half,
        "zero_cost_added_p50_ms": at_half.p50_ms,
        "zero_cost_added_p99_ms": at_half.p99_ms,
        "zero_cost_added_p999_ms": at_half.p999_ms,
        "zero_cost_half_trial": asdict(at_half),
    }


async def at_rates(
    options: BenchOptions, kafka: KafkaSettings, workdir: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    trials = []
    for rate in options.rates:
        trial = await run_trial(options, kafka, rate, workdir, say, read_events=True)
        say(describe(trial))
        trials.append(trial)

    def key(t: Trial) -> str:
        """JSON keys by offered rate."""
        return f"{t.offered_rps:g}"

    top = max(trials, key=lambda t: t.throughput_rps)
    return {
        "model_runner": options.runner,
        "model_rps": top.throughput_rps,
        "model_tokens_per_s": top.tokens_per_s,
        "model_rps_by_rate": {key(t): t.throughput_rps for t in trials},
        "model_tokens_per_s_by_rate": {key(t): t.tokens_per_s for t in trials},
        "model_p50_ms": {key(t): t.p50_ms for t in trials},
        "model_p99_ms": {key(t): t.p99_ms for t in trials},
        "model_p999_ms": {key(t): t.p999_ms for t in trials},
        "model_trials": [asdict(t) | {"sustained": t.sustained} for t in trials],
    }


@contextlib.asynccontextmanager
async def bench_broker(
    bootstrap: str | None, workdir: Path, say: Callable[[str], None]
) -> AsyncIterator[KafkaSettings]:
    """The broker at `bootstrap`, or a local one started for the bench and stopped after it."""
    from pipeline.tools.devtools.localkafka import LocalKafka

    if bootstrap is not None:
        yield KafkaSettings(bootstrap_servers=bootstrap)
        return
    broker = LocalKafka(workdir / "kafka")
    say("starting a local Kafka broker ...")
    await asyncio.to_thread(broker.start, 120.0)
    try:
        yield KafkaSettings(bootstrap_servers=broker.bootstrap)
    finally:
        await asyncio.to_thread(broker.stop)


async def run_bench(
    options: BenchOptions,
    *,
    find_max_mode: bool,
    rates_mode: bool,
    say: Callable[[str], None] = print,
    llm_modes_list: tuple[LlmMode, ...] = LLM_MODES,
    equal_tokens: int = 64,
    llm_mixes: tuple[str, ...] = ("mixed", "equal"),
    profile_now: bool = False,
    budgets: tuple[int | None, ...] = (None,),
    fusions: tuple[bool | None, ...] = (None,),
    trace: tuple[Path, TraceSlice, float | None] | None = None,
) -> dict[str, Any]:
    """Start (or reuse) a broker and run the requested modes; returns the JSON-ready figures.

    find-max always uses the zero-cost runner (it measures the pipeline);
    the rates mode uses `options.runner`.
    """
    workdir = Path(tempfile.mkdtemp(prefix="batchtide-bench-"))
    started = time.monotonic()
    figures: dict[str, Any] = {}
    async with bench_broker(options.bootstrap, workdir, say) as kafka:
        if trace is not None:
            path, window, share = trace
            figures["trace_replay"] = await trace_live(options, kafka, workdir, say, path, window, share, profile_now)
        if find_max_mode:
            say("zero-cost runner: finding the max sustained rate")
            ramp = replace(options, runner="zero-cost", duration_s=options.find_max_duration_s)
            figures |= await find_max(ramp, kafka, workdir, say)
        if rates_mode and options.runner == "smollm":
            say(f"smollm at {', '.join(f'{r:g}' for r in options.rates)} req/s, modes {', '.join(llm_modes_list)}")
            figures |= await llm_modes(
                options, kafka, workdir, say, llm_modes_list, equal_tokens, llm_mixes, profile_now, budgets, fusions
            )
        elif rates_mode:
            say(f"{options.runner} runner at {', '.join(f'{r:g}' for r in options.rates)} req/s")
            figures |= await at_rates(options, kafka, workdir, say)
    commands = replay_commands(figures)
    if commands:
        say("replay each recorded trial (and check the prediction for what ran against it) with:")
        for command in commands:
            say(f"  {command}")
    figures["options"] = asdict(options)
    figures["machine"] = {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "wall_s": time.monotonic() - started}
    figures["workdir"] = str(workdir)
    return figures
