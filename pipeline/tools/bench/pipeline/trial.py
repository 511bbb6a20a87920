"""One offered rate through the real pipeline, and the figures it yields (`Trial`).

A trial gets fresh topics and fresh consumer processes, waits for the group,
warms up, sends its open-loop load, drains the answers and reads the
consumers' events: every figure end to end on the client's clock.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import ensure_topics
from pipeline.tools.bench.pipeline.co_tenant import CoTenant
from pipeline.tools.bench.pipeline.consumers import BenchConsumers
from pipeline.tools.bench.pipeline.event_figures import EventFigures, event_figures, percentile
from pipeline.tools.bench.pipeline.lengths import draw
from pipeline.tools.bench.pipeline.options import MODEL, BenchOptions
from pipeline.tools.bench.pipeline.record import replay_command, store_events, trial_dir
from pipeline.tools.devtools.producer import Load, LoadProducer, poisson_load
from pipeline.tools.harness.errors import HarnessError
from pipeline.tools.harness.results import ResultArrivals

SUSTAINED_SHARE = 0.95
"""A rate is sustained when at least this share of what was offered is answered in the run."""
SUSTAINED_P99_MS = 1000.0
"""...and the p99 stays under this (a queue that grows all run long fails it)."""
DRAIN_S = 5.0
"""After the last send, answers still count for this long (then the run is cut)."""
WARMUP_REQUESTS = 150
"""Not counted: 3 s at 50 req/s. For about the first 1.5 s of traffic through a freshly started
broker JVM (the bench starts one), Kafka hops take up to 15-85 ms instead of 1-7; 40 warm-up
requests left that inside the measured window, where it set the p99 of a 30 s run."""
STEADY_SKIP_S = 1.0
"""Throughput counts answers arriving from this long after the first send to the end of
the send window: a pipeline that keeps up answers at the offered rate there, one that
falls behind answers at its capacity."""
WINDOW_S = 5.0
"""Width of the windows of `Trial.p99_by_window_ms` (how fast a slowdown's tail clears)."""
LLM_STEADY_FROM = 0.5
"""Generation: the throughput window is the send window from this share of it on (the running
set takes seconds to fill, each request lives for seconds)."""
LLM_IDLE_S = 60.0
"""Generation: the drain waits for every answer, but stops after this long without a new one."""
LLM_DRAIN_MAX_S = 600.0
"""Generation: the longest drain after the last send."""


@dataclass
class Trial:
    offered_rps: float
    duration_s: float
    sent: int
    answered: int
    achieved_send_rps: float
    throughput_rps: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    send_late_p99_ms: float
    outcomes: dict[str, int] = field(default_factory=dict)
    consumers: int = 1
    generated_tokens_per_s: float = 0.0
    """Generation: output tokens of the answered requests over first send -> last answer."""
    steady_generated_tokens_per_s: float = 0.0
    """Generation: tokens generated while the load was offered, over its second half (from the
    token stamps of every answered request): the offered token rate when the consumer keeps up,
    its capacity when it does not. What the table's `gen tok/s` and share of the limit use."""
    drain_s: float = 0.0
    """Seconds waited after the last send for the answers."""
    consumer_cpu_ms_per_request: float = float("nan")
    """CPU of the consumer processes (device processes included) over the load, per request sent."""
    mean_batch: float = float("nan")
    stages_p50_ms: dict[str, float] = field(default_factory=dict)
    stages_p99_ms: dict[str, float] = field(default_factory=dict)
    ttft_p50_ms: float = float("nan")
    ttft_p99_ms: float = float("nan")
    long_ttft_p99_ms: float = float("nan")
    """TTFT p99 of the requests with a long prompt (`event_figures.long_prompt`)."""
    tpot_p50_ms: float = float("nan")
    tpot_p99_ms: float = float("nan")
    rss_start_mib: float = float("nan")
    """Resident memory of the consumer processes (device processes included) when the load began."""
    rss_peak_mib: float = float("nan")
    """...its highest sample (every RSS_SAMPLE_S) over the load and the drain."""
    rss_end_mib: float = float("nan")
    """...after the drain: bounded memory ends near where it started, a leak or an unbounded queue does not."""
    by_consumer: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per answering consumer: requests, share, p50_ms, p99_ms; generation with the events read also
    ttft_p99_ms, tpot_p99_ms and generated_tokens_per_s (over the second half of the load)."""
    forwarded: int = 0
    """Requests the consumers handed to a peer (from their logs' last counters)."""
    duplicates: int = 0
    """Answers of the load's requests that arrived more than once (exactly once: 0)."""
    p99_by_window_ms: list[float] = field(default_factory=list)
    """e2e p99 of the requests sent in each WINDOW_S of the load, in order."""
    goodput_rps: float = float("nan")
    """Generation: requests answered within both the TTFT and the TPOT objective, per second of load."""
    slo_attainment: float = float("nan")
    """Generation: the share of the requests sent that met both objectives."""
    replay_command: str = ""
    """`--record`: the `batchtide replay` command that replays this trial from its recording."""
    repeated_past_dedup: int = 0
    """Of those, answers a reader keeping the first per id (`FirstAnswers`) would still hand out."""

    @property
    def sustained(self) -> bool:
        return (
            self.answered >= SUSTAINED_SHARE * self.sent
            and self.throughput_rps >= SUSTAINED_SHARE * self.offered_rps
            and self.p99_ms <= SUSTAINED_P99_MS
        )


def skewed(load: Load, partitions: int, hot_share: float, seed: int) -> Load:
    """Send `hot_share` of the requests to partition 0 and spread the rest over the others."""
    if hot_share <= 0 or partitions < 2:
        return load
    rng = np.random.default_rng(seed + 7)
    hot = rng.random(len(load)) < hot_share
    others = rng.integers(1, partitions, size=len(load))
    return replace(load, partition=np.where(hot, 0, others))


def with_new_tokens(load: Load, options: BenchOptions, seed: int, fixed: int | None = None) -> Load:
    """The LLM load's prompt sizes and max_new_tokens per request: `fixed` new tokens (warm-up),
    all `options.new_tokens` (the `equal` mix), or the options' length mix."""
    if options.runner != "smollm":
        return load
    if fixed:
        return replace(load, new_tokens=np.full(len(load), fixed, dtype=np.int64))
    name = "equal" if options.new_tokens else options.lengths
    mix = draw(name, len(load), seed, tokens=options.tokens, equal_tokens=options.new_tokens)
    return replace(load, tokens=mix.prompts, new_tokens=mix.new_tokens)


async def run_trial(
    options: BenchOptions,
    base: KafkaSettings,
    rate: float,
    workdir: Path,
    say: Callable[[str], None],
    *,
    read_events: bool = False,
    load: Load | None = None,
) -> Trial:
    """One offered rate on fresh topics with fresh consumer processes (`load`: this load, sent as it is,
    instead of Poisson arrivals at `rate`)."""
    kafka = replace(base, topic_prefix=f"bench-{uuid.uuid4().hex[:8]}")
    await ensure_topics(kafka, {MODEL: options.partitions})
    record = trial_dir(options, rate)
    consumers = BenchConsumers(options, kafka, workdir, record)
    arrivals = ResultArrivals(kafka, MODEL)
    tenant = CoTenant(consumers.core_of(0), workdir) if options.co_tenant is not None else None
    consumers.start()
    if tenant is not None and options.co_tenant is not None and options.co_tenant[0] is None:
        tenant.start()
    await arrivals.start()
    try:
        await consumers.wait_for_group()
        async with LoadProducer(kafka, MODEL, run_id="bench", seed=options.seed) as producer:
            llm = options.runner == "smollm"
            warmup = (
                poisson_load(4.0, options.llm_warmup_s, options.seed, tokens=options.tokens)
                if llm
                else poisson_load(50.0, WARMUP_REQUESTS / 50.0, options.seed, tokens=options.tokens)
            )
            warmup = with_new_tokens(warmup, options, options.seed, fixed=8)
            await producer.send(warmup, tag="warm-", warmup=True)
            warm_ids = list(producer.sent_ms)
            for _ in range(int(120 / 0.5)):
                await arrivals.wait_for(warm_ids, 0.5)
                consumers.check_alive()
                if all(i in arrivals.received_ms for i in warm_ids):
                    break
            else:
                raise HarnessError("consumers did not answer the warm-up requests within 120 s")
            if load is None:
                load = skewed(
                    with_new_tokens(
                        poisson_load(rate, options.duration_s, options.seed, tokens=options.tokens),
                        options,
                        options.seed,
                    ),
                    options.partitions,
                    options.hot_share,
                    options.seed,
                )
                load = replace(load, timeout_ms=options.timeout_ms)
            say(
                f"  offered {rate:g} req/s for {options.duration_s:g} s ({len(load)} requests, {options.consumers} consumer(s))"
            )
            producer.sent_ms.clear()
            late = leaving = None
            if consumers.at_start < options.consumers:
                delay = options.late_consumer_s or 0.0
                last = range(consumers.at_start, options.consumers)
                late = asyncio.get_running_loop().call_later(delay, consumers.start, last)
            if options.leaving_consumer_s is not None:
                leaving = asyncio.get_running_loop().call_later(
                    options.leaving_consumer_s, consumers.stop_one, options.consumers - 1
                )
            cpu_before = consumers.cpu_s()
            rss_start = consumers.rss_mib()
            rss_peak = [rss_start]
            sampler = asyncio.create_task(consumers.sample_rss(rss_peak))
            timers = co_tenant_timers(tenant, options.co_tenant)
            try:
                consumers.slow_down(time.time() * 1000.0)
                report = await producer.send(load)
                for timer in (late, leaving):
                    if timer is not None:
                        timer.cancel()
                ids = list(producer.sent_ms)
                if llm:
                    drained_s = await arrivals.drain(ids, LLM_IDLE_S, LLM_DRAIN_MAX_S)
                else:
                    await arrivals.wait_for(ids, DRAIN_S)
                    drained_s = DRAIN_S
            finally:
                sampler.cancel()
                for timer in timers:
                    timer.cancel()
            consumer_cpu_s = consumers.cpu_s() - cpu_before
            rss_end = consumers.rss_mib()
            sent_ms = producer.sent_ms
        consumers.check_alive()
        answered = [i for i in ids if i in arrivals.received_ms]
        latencies = np.array([arrivals.received_ms[i] - sent_ms[i] for i in answered])
        first_send = min(sent_ms.values()) if sent_ms else 0.0
        last_answer = max((arrivals.received_ms[i] for i in answered), default=first_send)
        span_s = max((last_answer - first_send) / 1000.0, options.duration_s, 1e-9)
        steady = [arrivals.received_ms[i] - first_send for i in answered]
        window_s = max(options.duration_s - STEADY_SKIP_S, 1e-9)
        in_window = sum(1 for t in steady if STEADY_SKIP_S * 1000.0 <= t < options.duration_s * 1000.0)
        timeline = np.array([[sent_ms[i] - first_send, arrivals.received_ms[i] - sent_ms[i]] for i in answered])
        np.save(workdir / f"{kafka.topic_prefix}-latency.npy", timeline)
        window_ms = (
            first_send + LLM_STEADY_FROM * options.duration_s * 1000.0,
            first_send + options.duration_s * 1000.0,
        )
        events = (
            await event_figures(
                kafka,
                {i: arrivals.received_ms[i] for i in answered},
                window_ms=window_ms if llm else None,
                objectives=(options.ttft_slo_ms, options.tpot_slo_ms) if llm else None,
            )
            if read_events and answered
            else EventFigures()
        )
        outcomes: dict[str, int] = {}
        for i in answered:
            outcomes[arrivals.outcomes[i]] = outcomes.get(arrivals.outcomes[i], 0) + 1
        steady_s = (window_ms[1] - window_ms[0]) / 1000.0
        each = by_consumer(answered, arrivals, latencies)
        for name, figures in events.by_consumer.items():
            tokens = figures.pop("window_tokens_out")
            each.setdefault(name, {}).update(figures, generated_tokens_per_s=tokens / steady_s)
        trial = Trial(
            by_consumer=each,
            p99_by_window_ms=windowed_p99(timeline, options.duration_s),
            offered_rps=rate,
            duration_s=options.duration_s,
            sent=len(ids),
            answered=len(answered),
            duplicates=sum(arrivals.repeats.get(i, 0) for i in ids),
            achieved_send_rps=report.achieved_rate,
            throughput_rps=in_window / window_s,
            tokens_per_s=events.tokens / span_s,
            generated_tokens_per_s=events.tokens_out / span_s,
            steady_generated_tokens_per_s=events.window_tokens_out / steady_s,
            drain_s=drained_s,
            mean_batch=events.mean_batch,
            stages_p50_ms=events.stages_p50_ms,
            stages_p99_ms=events.stages_p99_ms,
            p50_ms=percentile(latencies, 50),
            p99_ms=percentile(latencies, 99),
            p999_ms=percentile(latencies, 99.9),
            max_ms=float(latencies.max()) if latencies.size else float("nan"),
            send_late_p99_ms=report.late_ms_p99,
            outcomes=outcomes,
            consumers=options.consumers,
            consumer_cpu_ms_per_request=consumer_cpu_s * 1000.0 / max(len(ids), 1),
            ttft_p50_ms=events.ttft_ms[0],
            ttft_p99_ms=events.ttft_ms[1],
            long_ttft_p99_ms=events.long_ttft_p99_ms,
            tpot_p50_ms=events.tpot_ms[0],
            tpot_p99_ms=events.tpot_ms[1],
            rss_start_mib=rss_start,
            rss_peak_mib=max(rss_peak[0], rss_end),
            rss_end_mib=rss_end,
            goodput_rps=events.meeting_objectives / options.duration_s if llm and events.tokens else float("nan"),
            slo_attainment=events.meeting_objectives / max(len(ids), 1) if llm and events.tokens else float("nan"),
            repeated_past_dedup=arrivals.repeats_past_dedup,
        )
    finally:
        if tenant is not None:
            tenant.stop()
        await arrivals.stop()
        consumers.stop()
    # each consumer logs its counters every few seconds and once more as it stops: read after the
    # stop, or a trial shorter than that interval (and the forwards of its last seconds) reads 0
    trial = replace(trial, forwarded=consumers.forwarded())
    if record is None:
        return trial
    await store_events(kafka, record, consumers.processes, say)
    return replace(trial, replay_command=replay_command(record))


def co_tenant_timers(
    tenant: CoTenant | None, span: tuple[float | None, float | None] | None
) -> list[asyncio.TimerHandle]:
    """Start and stop the co-tenant at its span's ends, counted from now (the load's start)."""
    if tenant is None or span is None:
        return []
    loop = asyncio.get_running_loop()
    start_s, end_s = span
    timers = [] if start_s is None else [loop.call_later(start_s, tenant.start)]
    return timers + ([] if end_s is None else [loop.call_later(end_s, tenant.stop)])


def by_consumer(answered: list[str], arrivals: ResultArrivals, latencies: np.ndarray) -> dict[str, dict[str, float]]:
    """Requests, share and e2e p50/p99 of each consumer that answered."""
    groups: dict[str, list[float]] = {}
    for request_id, latency in zip(answered, latencies, strict=True):
        groups.setdefault(arrivals.consumers.get(request_id, ""), []).append(float(latency))
    return {
        name: {
            "requests": len(values),
            "share": len(values) / max(len(answered), 1),
            "p50_ms": percentile(np.array(values), 50),
            "p99_ms": percentile(np.array(values), 99),
        }
        for name, values in sorted(groups.items())
    }


def windowed_p99(timeline: np.ndarray, duration_s: float) -> list[float]:
    """e2e p99 of the requests sent in each WINDOW_S of the load (NaN for an empty window)."""
    if timeline.size == 0:
        return []
    windows = max(1, int(np.ceil(duration_s / WINDOW_S)))
    index = np.minimum((timeline[:, 0] // (WINDOW_S * 1000.0)).astype(int), windows - 1)
    return [percentile(timeline[index == w, 1], 99) for w in range(windows)]
