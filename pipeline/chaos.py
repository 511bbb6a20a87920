"""Fault injection against the real pipeline: real broker, real processes, really killed.

One harness serves both the `tests/faults/` suite and `batchtide chaos`, so
the table a person reads and the assertions CI makes come from the same run
of the same code. A scenario starts consumers and the sink as subprocesses
(`python -m pipeline.cli consume|sink`), drives open-loop traffic with known
request ids, injects its fault (SIGKILL, broker stop, ClickHouse outage,
poison input, overload, group churn) and accounts for every id:

- *lost*: sent, never answered (no Result and no dead letter);
- *duplicated*: extra Results for an id already answered (at-least-once);
- *recovery*: seconds from the end of the fault until every request sent
  before that moment was answered (for the ClickHouse faults: until every
  latency event is a ClickHouse row).

A scenario never decides success by itself being quiet: it returns a
`FaultReport` whose `failures` list names every broken promise.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from consumers.kafka import Topics, client_options, ensure_topics, stable_group_size
from consumers.localkafka import LocalKafka, port_is_free
from consumers.runners.cost_model import POISON_MARKER
from pipeline.chaos_hostile import hostile_input
from pipeline.config import KafkaSettings
from schemas.messages import DeadLetter, LatencyEvent, Request, Result

CHAOS_MODEL = "chaos"
DISPATCH_SLACK_MS = 5
"""Event times are whole milliseconds on one clock; this absorbs the rounding."""
SINK_ENV = {"BROKER_SESSION_TIMEOUT": "10"}
"""faust reads its settings from the environment too. Its default session timeout
(60 s) makes a crashed sink's partitions wait a minute before a restarted sink
may take them; the harness deploys the sink as an operator should, with the
same 10 s the consumers' aiokafka default uses."""
REPO_ROOT = Path(__file__).resolve().parent.parent


# -- what a scenario reports ---------------------------------------------------


@dataclass
class FaultReport:
    """One row of the chaos table, plus the figures behind its verdict."""

    fault: str
    injections: int
    requests_in: int
    results_out: int
    """Distinct request ids answered (a Result, or a dead letter for rejected input)."""
    lost: int
    duplicated: int
    """Extra Results beyond the first per request id."""
    duplicate_bound: int | None
    """Most duplicates the scenario's promise allows (None: duplicates are reported, not bounded)."""
    recovery_s: float | None
    failures: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures


class ChaosError(RuntimeError):
    """The harness could not set up or drive a scenario (not a verdict on the pipeline)."""


# -- bookkeeping of every request id --------------------------------------------


@dataclass(frozen=True)
class Answer:
    at: float
    """Wall-clock seconds when the harness saw the Result."""
    outcome: str
    consumer_id: str | None
    batch_id: int | None
    enqueue_ms: int
    done_ms: int


class Ledger:
    """Every id sent, and every Result and dead letter seen for it."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.results: dict[str, list[Answer]] = {}
        self.dead: dict[str, list[DeadLetter]] = {}
        self.dispatched_ms: dict[str, int] = {}
        """When the consumer put each request into a batch (first LatencyEvent; collected on demand)."""
        self._first_answer: dict[str, float] = {}

    def record_sent(self, request_id: str, at: float) -> None:
        self.sent[request_id] = at

    def record_result(self, result: Result, at: float) -> None:
        answer = Answer(at, result.outcome, result.consumer_id, result.batch_id, result.enqueue_ms, result.done_ms)
        self.results.setdefault(result.id, []).append(answer)
        self._first_answer.setdefault(result.id, at)

    def record_timing(self, event: LatencyEvent) -> None:
        if event.outcome == "ok":
            self.dispatched_ms.setdefault(event.request_id, event.dispatch_ms)

    def record_dead(self, letter: DeadLetter, at: float) -> None:
        if letter.request_id is None:
            return
        self.dead.setdefault(letter.request_id, []).append(letter)
        self._first_answer.setdefault(letter.request_id, at)

    def unanswered(self, ids: Iterable[str] | None = None) -> list[str]:
        return [i for i in (self.sent if ids is None else ids) if i not in self._first_answer]

    @property
    def answered_count(self) -> int:
        return sum(1 for i in self.sent if i in self._first_answer)

    @property
    def duplicated(self) -> int:
        return sum(len(answers) - 1 for i, answers in self.results.items() if i in self.sent and len(answers) > 1)

    def duplicated_ids(self) -> list[str]:
        return [i for i, answers in self.results.items() if i in self.sent and len(answers) > 1]

    def outcomes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for i, answers in self.results.items():
            if i in self.sent:
                counts[answers[0].outcome] = counts.get(answers[0].outcome, 0) + 1
        return counts

    def caught_up_at(self, moment: float) -> float | None:
        """When every request sent before `moment` had its first answer (None: not all have)."""
        latest = moment
        for request_id, sent_at in self.sent.items():
            if sent_at > moment:
                continue
            first = self._first_answer.get(request_id)
            if first is None:
                return None
            latest = max(latest, first)
        return latest

    def recovery_after(self, fault_end: float) -> float | None:
        caught_up = self.caught_up_at(fault_end)
        return None if caught_up is None else round(caught_up - fault_end, 2)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100.0 * len(ordered) + 0.5)) - 1))
    return ordered[rank]


# -- Kafka clients of the harness ------------------------------------------------


class Collector:
    """Reads the results and DLQ topics (and optionally the latency events) from the start into
    a Ledger, surviving broker restarts."""

    def __init__(self, settings: KafkaSettings, model: str, ledger: Ledger, *, latency_events: bool = False) -> None:
        topics = Topics(settings.topic_prefix)
        self._results_topic = topics.results(model)
        self._dlq_topic = topics.dlq
        self._latency_topic = topics.latency_events
        self._ledger = ledger
        self._consumer = AIOKafkaConsumer(
            self._results_topic,
            self._dlq_topic,
            *([self._latency_topic] if latency_events else []),
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            isolation_level="read_committed",
            request_timeout_ms=30_000,
            **client_options(settings),
        )
        self._task: asyncio.Task[None] | None = None
        self._result_decoder = msgspec.json.Decoder(Result)
        self._dead_decoder = msgspec.json.Decoder(DeadLetter)
        self._latency_decoder = msgspec.json.Decoder(LatencyEvent)

    async def start(self) -> None:
        await self._consumer.start()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=200, max_records=2000)
            now = time.time()
            for tp, records in batches.items():
                for record in records:
                    if record.value is None:
                        continue
                    if tp.topic == self._results_topic:
                        self._ledger.record_result(self._result_decoder.decode(record.value), now)
                    elif tp.topic == self._latency_topic:
                        self._ledger.record_timing(self._latency_decoder.decode(record.value))
                    else:
                        self._ledger.record_dead(self._dead_decoder.decode(record.value), now)

    async def wait_answered(self, ids: Iterable[str], timeout_s: float) -> bool:
        wanted = list(ids)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._task is not None and self._task.done():
                self._task.result()
            if not self._ledger.unanswered(wanted):
                return True
            await asyncio.sleep(0.1)
        return not self._ledger.unanswered(wanted)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._consumer.stop()


class Traffic:
    """Open-loop producer of requests with known ids: sends on schedule, never waits for answers."""

    def __init__(self, settings: KafkaSettings, model: str, ledger: Ledger, run_id: str) -> None:
        self._topic = Topics(settings.topic_prefix).requests(model)
        self._model = model
        self._ledger = ledger
        self._run_id = run_id
        self._next = 0
        self._producer = AIOKafkaProducer(
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            request_timeout_ms=120_000,
            **client_options(settings),
        )
        self._pending: list[asyncio.Future[Any]] = []
        self.placement: dict[str, tuple[tuple[str, int], int]] = {}
        """Where each request landed: ((topic, partition), offset), once the broker acknowledged it."""

    async def start(self) -> None:
        await self._producer.start()

    def new_id(self) -> str:
        self._next += 1
        return f"{self._run_id}-{self._next:07d}"

    async def send(self, text: str = "chaos", *, timeout_ms: int | None = None, request_id: str | None = None) -> str:
        request_id = request_id or self.new_id()
        req = Request(id=request_id, model=self._model, text=text, timeout_ms=timeout_ms)
        delivery = await self._producer.send(self._topic, msgspec.json.encode(req), key=request_id.encode())
        self._ledger.record_sent(request_id, time.time())
        delivery.add_done_callback(lambda f, rid=request_id: self._placed(rid, f))
        self._pending.append(delivery)
        return request_id

    def _placed(self, request_id: str, delivery: asyncio.Future[Any]) -> None:
        if not delivery.cancelled() and delivery.exception() is None:
            meta = delivery.result()
            self.placement[request_id] = ((meta.topic, meta.partition), meta.offset)

    async def open_loop(
        self,
        count: int,
        rate_rps: float,
        *,
        timeout_ms: int | None = None,
        text_for: Callable[[int], str] | None = None,
        until: Callable[[], bool] | None = None,
    ) -> list[str]:
        """Send `count` requests at `rate_rps` on a fixed schedule (arrivals do not wait for answers),
        or fewer if `until()` turns true first."""
        ids: list[str] = []
        start = time.monotonic()
        for i in range(count):
            if until is not None and until():
                break
            delay = start + i / rate_rps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            text = text_for(i) if text_for is not None else "chaos"
            ids.append(await self.send(text, timeout_ms=timeout_ms))
        return ids

    async def flush(self) -> None:
        """Wait until every send so far is acknowledged by the broker (raises on a lost send)."""
        pending, self._pending = self._pending, []
        await asyncio.gather(*pending)

    async def stop(self) -> None:
        await self.flush()
        await self._producer.stop()


# -- subprocesses -----------------------------------------------------------------


class Proc:
    """A pipeline process (consumer or sink) run by the harness so it can be really killed."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.extra_env = dict(env or {})
        self.log_path = log_dir / f"{name}.log"
        self._popen: subprocess.Popen[bytes] | None = None
        self.meant_up = False
        """Started and not deliberately stopped: if it is not alive, it crashed."""

    def start(self) -> None:
        """Start (again); the process dies with the harness (pdeathsig), so no run leaves strays."""
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }
        guard = shutil.which("setpriv")
        argv = [guard, "--pdeathsig", "KILL", *self.argv] if guard else self.argv
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            self._popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=env,
            )
        self.meant_up = True

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, in-flight work is lost as in a crash."""
        self.meant_up = False
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(signal.SIGKILL)
            self._popen.wait(timeout=10)

    def request_stop(self) -> None:
        """SIGTERM without waiting: the process leaves its group cleanly in its own time."""
        self.meant_up = False
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)

    def terminate(self, timeout_s: float = 20.0) -> None:
        """SIGTERM and wait for a clean exit; SIGKILL if it does not come."""
        self.meant_up = False
        if self._popen is None or self._popen.poll() is not None:
            return
        self._popen.send_signal(signal.SIGTERM)
        try:
            self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def rss_bytes(self) -> int:
        if not self.alive or self.pid is None:
            return 0
        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def log_tail(self, lines: int = 25) -> str:
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class RssSampler:
    """Peak resident memory of some processes, sampled in the background."""

    def __init__(self, procs: list[Proc], every_s: float = 0.2) -> None:
        self._procs = procs
        self._every_s = every_s
        self.peak_bytes = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            for proc in self._procs:
                self.peak_bytes = max(self.peak_bytes, proc.rss_bytes())
            await asyncio.sleep(self._every_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


_COUNT_ROWS = """
import json, sys
from pipeline.config import ClickHouseSettings
from pipeline.store.client import connect
client = connect(ClickHouseSettings(data_dir=sys.argv[1]), database=sys.argv[2])
raw = client.query("SELECT request_id, count() FROM request_latency GROUP BY request_id").result_rows
final = client.query("SELECT count() FROM request_latency FINAL").result_rows[0][0]
print(json.dumps({"raw_per_id": {r[0]: r[1] for r in raw}, "final_rows": final}))
"""
"""Run in a child process: chDB lets one process open a data directory, and the
harness may need several directories in one run."""


class StorageFreeze:
    """A ClickHouse outage for the embedded engine: every table directory made immutable.

    chDB runs inside the sink's own process, so there is no connection to
    cut and no server to stop. Instead the table directories under the data
    dir get the immutable attribute (`chattr +i`, root on ext4/xfs): every
    insert then fails inside the real engine (it cannot create its part
    directory), reads still answer, and the sink sees exactly what a
    ClickHouse that refuses writes looks like until `thaw()`.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.frozen: list[Path] = []

    def freeze(self) -> None:
        tables = sorted(p for p in self.data_dir.glob("store/*/*") if p.is_dir())
        if not tables:
            raise ChaosError(f"no table directories under {self.data_dir}/store to freeze")
        for table in tables:
            self._chattr("+i", table)
            self.frozen.append(table)

    def thaw(self) -> None:
        while self.frozen:
            self._chattr("-i", self.frozen.pop())

    @staticmethod
    def _chattr(flag: str, path: Path) -> None:
        try:
            done = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise ChaosError("chattr is not installed: the ClickHouse outage cannot be injected") from None
        if done.returncode != 0:
            raise ChaosError(f"chattr {flag} {path} failed (needs root and ext4/xfs): {done.stderr.strip()}")


# -- a deployment under test ------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """The simulated device of the cost-model runner: t(b) = a + c*b, so capacity is known."""

    a_ms: float = 20.0
    c_ms: float = 2.0
    target_size: int = 8
    hard_cap: int = 16
    max_wait_ms: float = 10.0

    def batch_ms(self, size: int) -> float:
        return self.a_ms + self.c_ms * size

    @property
    def capacity_rps(self) -> float:
        """Most requests per second one consumer can serve: full batches back to back."""
        return self.hard_cap * 1000.0 / self.batch_ms(self.hard_cap)


@dataclass
class Stage:
    """Where a scenario runs: a broker, its own topic prefix and a work directory.

    `broker` is set only when the scenario may stop and restart the broker;
    such a scenario must never be given a broker other tests share.
    """

    workdir: Path
    kafka: KafkaSettings
    broker: LocalKafka | None = None
    """A broker owned by this stage (scenarios that restart it need one), or None."""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} to TOML")


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """A config file from {table: {key: scalar}}; enough for batchtide's flat tables."""
    lines: list[str] = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines.extend(f"{key} = {_toml_value(v)}" for key, v in values.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


class Deployment:
    """One scenario's pipeline: its config file, consumer and sink processes, and the harness clients.

    Use as `async with Deployment(...) as d:`; every process it started is
    stopped on the way out, also when the scenario fails.
    """

    def __init__(
        self,
        stage: Stage,
        device: Device,
        *,
        partitions: int = 4,
        poison_marker: str | None = None,
        transactional: bool = False,
        consumer: dict[str, Any] | None = None,
        clickhouse: dict[str, Any] | None = None,
        collect_latency_events: bool = False,
    ) -> None:
        self.stage = stage
        self.device = device
        self.partitions = partitions
        self.settings = stage.kafka
        self.topics = Topics(stage.kafka.topic_prefix)
        self.clickhouse_dir = stage.workdir / "clickhouse"
        self.log_dir = stage.workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        model = {
            "runner": "cost-model",
            "cost_a_ms": device.a_ms,
            "cost_c_ms": device.c_ms,
            "target_size": device.target_size,
            "hard_cap": device.hard_cap,
            "max_wait_ms": device.max_wait_ms,
            "adaptive_cap": False,
            "partitions": partitions,
            "poison_marker": poison_marker,
        }
        kafka = {
            "bootstrap_servers": stage.kafka.bootstrap_servers,
            "topic_prefix": stage.kafka.topic_prefix,
            "transactional": transactional,
        }
        self.config_path = self.write_config(
            "config.toml",
            {
                "kafka": kafka,
                "clickhouse": {"data_dir": str(self.clickhouse_dir), "insert_interval_ms": 300.0, **(clickhouse or {})},
                "consumer": dict(consumer or {}),
                f"models.{CHAOS_MODEL}": model,
            },
        )
        self.ledger = Ledger()
        self.run_id = uuid.uuid4().hex[:8]
        self.collector = Collector(stage.kafka, CHAOS_MODEL, self.ledger, latency_events=collect_latency_events)
        self.traffic = Traffic(stage.kafka, CHAOS_MODEL, self.ledger, self.run_id)
        self.consumers: dict[str, Proc] = {}
        self.sinks: list[Proc] = []
        self._sink_group_id: str | None = None

    def write_config(self, name: str, tables: dict[str, dict[str, Any]]) -> Path:
        path = self.stage.workdir / name
        path.write_text(toml_text(tables))
        return path

    async def __aenter__(self) -> "Deployment":
        await ensure_topics(self.settings, {CHAOS_MODEL: self.partitions})
        await self.collector.start()
        await self.traffic.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for proc in [*self.consumers.values(), *self.sinks]:
            proc.terminate(timeout_s=10)
        try:
            await self.traffic.stop()
        finally:
            await self.collector.stop()

    # -- processes --

    def consumer(self, consumer_id: str) -> Proc:
        """Start a consumer process of the model's group (a new process on every call)."""
        argv = [
            sys.executable, "-m", "pipeline.cli", "consume",
            "--model", CHAOS_MODEL, "--config", str(self.config_path), "--consumer-id", consumer_id,
        ]  # fmt: skip
        proc = self.consumers.get(consumer_id) or Proc(f"consumer-{consumer_id}", argv, self.log_dir)
        self.consumers[consumer_id] = proc
        proc.start()
        return proc

    def sink(self, config_path: Path | None = None, name: str = "sink") -> Proc:
        """Start a sink process (`batchtide sink`) on the deployment's config."""
        argv = [sys.executable, "-m", "pipeline.cli", "sink", "--config", str(config_path or self.config_path)]
        proc = Proc(f"{name}-{len(self.sinks)}", argv, self.log_dir, env=SINK_ENV)
        self.sinks.append(proc)
        proc.start()
        return proc

    def check_alive(self) -> None:
        """Raise if a process the scenario did not stop has died (a crash is not a fault we injected)."""
        for proc in [*self.consumers.values(), *self.sinks]:
            if proc.meant_up and not proc.alive:
                raise ChaosError(f"{proc.name} exited unexpectedly; its log ends:\n{proc.log_tail()}")

    async def warm_up(self, consumers: int = 1, timeout_s: float = 90.0) -> None:
        """Return once `consumers` processes are in the group and answering requests."""
        deadline = time.monotonic() + timeout_s
        await self.wait_group_size(consumers, deadline - time.monotonic())
        ids = [await self.traffic.send("warm-up") for _ in range(max(4, 2 * self.partitions))]
        await self.traffic.flush()
        if not await self.collector.wait_answered(ids, max(5.0, deadline - time.monotonic())):
            self.check_alive()
            raise ChaosError(f"warm-up requests not answered within {timeout_s} s")
        for request_id in ids:
            self.ledger.sent.pop(request_id, None)

    async def wait_group_size(self, members: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        size = -1
        while time.monotonic() < deadline:
            self.check_alive()
            size = await stable_group_size(self.settings, consumer_group(self.settings, CHAOS_MODEL))
            if size == members:
                return
            await asyncio.sleep(0.3)
        raise ChaosError(f"consumer group has {size} members, expected {members}, after {timeout_s:.0f} s")

    # -- events in ClickHouse --

    async def latency_end_offsets(self) -> dict[tuple[str, int], int]:
        """End offsets of the latency-events topic now: what the sink must have committed to be caught up."""
        return await end_offsets(self.settings, self.topics.latency_events)

    async def events_caught_up(self, timeout_s: float, target: dict[tuple[str, int], int] | None = None) -> float | None:
        """Wait until the sink's group has committed the latency topic up to `target` (default: its
        end now). The sink commits only after its insert, so then every event up to there is a row.
        Returns the wall-clock time it happened, or None on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                wanted = target if target is not None else await self.latency_end_offsets()
                group = await self._sink_group()
                if group is not None:
                    committed = await committed_offsets(self.settings, group)
                    if all(committed.get(tp, 0) >= end for tp, end in wanted.items()):
                        return time.time()
            except Exception:  # noqa: BLE001 - broker still coming back: ask again
                pass
            await asyncio.sleep(0.3)
        return None

    async def sink_ready(self, timeout_s: float) -> None:
        """Return once the sink has stored and committed the warm-up's events."""
        if await self.events_caught_up(timeout_s) is None:
            raise ChaosError(f"the sink did not commit the warm-up events within {timeout_s:.0f} s")

    async def _sink_group(self) -> str | None:
        """The sink's consumer group: the deployment's group that is not the model's consumers'.

        Found by asking the broker rather than by knowing the sink's app id, so
        the harness keeps working whatever the sink names its group.
        """
        if self._sink_group_id is not None:
            return self._sink_group_id
        own = consumer_group(self.settings, CHAOS_MODEL)
        admin = await _admin(self.settings)
        try:
            names = [g[0] for g in await admin.list_consumer_groups()]
        finally:
            await admin.close()
        ours = [n for n in names if n.startswith(self.settings.topic_prefix) and n != own]
        if len(ours) == 1:
            self._sink_group_id = ours[0]
        return self._sink_group_id

    async def sink_members(self) -> int:
        group = await self._sink_group()
        return 0 if group is None else await stable_group_size(self.settings, group)

    async def clickhouse_rows(self) -> dict[str, Any]:
        """Latency rows per request id, read from the embedded store (no sink may be running)."""
        if any(p.alive for p in self.sinks):
            raise ChaosError("stop the sink before reading its embedded ClickHouse directory")
        command = [sys.executable, "-c", _COUNT_ROWS, str(self.clickhouse_dir), "batchtide"]
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False
        )
        if done.returncode != 0:
            raise ChaosError(f"counting ClickHouse rows failed:\n{done.stderr[-2000:]}")
        return msgspec.json.decode(done.stdout.strip().splitlines()[-1])

    def event_accounting(self, rows: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
        """(events lost, events double-counted, details) against every request that was answered.

        Double-counted is judged on the raw table, not FINAL: the per-minute
        rollups see every inserted row, so the sink must not insert one twice."""
        per_id: dict[str, int] = rows["raw_per_id"]
        expected = {i for i, answers in self.ledger.results.items() if answers[0].outcome != "rejected"}
        missing = [i for i in expected if i not in per_id]
        double = sum(n - 1 for n in per_id.values() if n > 1)
        details = {
            "events_expected": len(expected),
            "rows": sum(per_id.values()),
            "rows_final": rows["final_rows"],
            "events_lost": len(missing),
            "events_double_counted": double,
        }
        return len(missing), double, details


# -- what the harness asks the broker -------------------------------------------------


def consumer_group(settings: KafkaSettings, model: str) -> str:
    """The group id the consumers of `model` join."""
    return Topics(settings.topic_prefix).group(model)


async def _admin(settings: KafkaSettings) -> AIOKafkaAdminClient:
    admin = AIOKafkaAdminClient(request_timeout_ms=10_000, **client_options(settings))
    await admin.start()
    return admin


async def committed_offsets(settings: KafkaSettings, group: str) -> dict[tuple[str, int], int]:
    """{(topic, partition): committed offset} of a group."""
    admin = await _admin(settings)
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items() if meta.offset >= 0}


async def end_offsets(settings: KafkaSettings, topic: str) -> dict[tuple[str, int], int]:
    """{(topic, partition): end offset} of every partition of `topic`."""
    admin = await _admin(settings)
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    partitions = sorted(p["partition"] for t in described if t["error_code"] == 0 for p in t["partitions"])
    if not partitions:
        raise ChaosError(f"topic {topic} does not exist (yet)")
    consumer = AIOKafkaConsumer(group_id=None, request_timeout_ms=10_000, **client_options(settings))
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
    finally:
        await consumer.stop()
    return {(tp.topic, tp.partition): offset for tp, offset in ends.items()}


# -- scenario sizes ---------------------------------------------------------------------


@dataclass(frozen=True)
class ChaosSizes:
    """How long and how hard each scenario pushes. `quick()` is what the test suite uses."""

    rate_rps: float = 80.0
    """Steady arrival rate of the scenarios that are not about overload."""
    requests: int = 1600
    """Requests of the steady scenarios (duration = requests / rate)."""
    outage_s: float = 20.0
    """How long the broker, or ClickHouse, stays away."""
    overload_s: float = 60.0
    overload_factor: float = 3.0
    """Arrival rate as a multiple of one consumer's capacity."""
    overload_timeout_ms: int = 2000
    """Deadline (relative timeout) carried by every overload request."""
    sink_kills: int = 2
    """Times the sink is SIGKILLed (each restart waits out the dead member's session)."""
    storm_s: float = 40.0
    storm_period_s: float = 3.0
    """How often the storm acts: stop a serving guest, or start a new one."""
    answer_timeout_s: float = 120.0
    """Longest a scenario waits for the last answer before declaring the rest lost."""

    @classmethod
    def quick(cls) -> "ChaosSizes":
        return cls(
            rate_rps=60.0,
            requests=600,
            outage_s=10.0,
            overload_s=15.0,
            sink_kills=1,
            storm_s=20.0,
            storm_period_s=2.0,
            answer_timeout_s=90.0,
        )


async def _until_holding_work(d: Deployment, consumer_id: str, timeout_s: float = 5.0, age_s: float = 0.010) -> None:
    """Wait for a moment when `consumer_id` holds work: a request on one of its partitions
    sent over `age_s` ago and not answered yet. A kill then interrupts a batch instead of
    landing between two (at this load a consumer is idle a third of the time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        placement = d.traffic.placement
        mine = {
            placement[request_id][0]
            for request_id, answers in d.ledger.results.items()
            if answers[0].consumer_id == consumer_id and request_id in placement
        }
        now = time.time()
        if any(
            now - sent_at > age_s and request_id in placement and placement[request_id][0] in mine
            for request_id, sent_at in d.ledger.sent.items()
            if request_id not in d.ledger.results
        ):
            return
        await asyncio.sleep(0.002)


def _finish(
    d: Deployment,
    fault: str,
    injections: int,
    *,
    fault_end: float | None,
    duplicate_bound: int | None = 0,
    failures: list[str] | None = None,
    details: dict[str, Any] | None = None,
    events: tuple[int, int] | None = None,
) -> FaultReport:
    """Turn the ledger into a report row; every broken promise becomes a failure line.

    `events`: (latency events lost, counted twice) in ClickHouse, for the
    scenarios that check the sink; they add to the row's lost and duplicated.
    """
    ledger = d.ledger
    lost = len(ledger.unanswered())
    duplicated = ledger.duplicated
    problems = list(failures or [])
    events_lost, events_double = events or (0, 0)
    if events_lost:
        problems.append(f"{events_lost} latency events never reached ClickHouse")
    if events_double:
        problems.append(f"{events_double} latency events counted twice")
    if lost:
        sample = ", ".join(ledger.unanswered()[:5])
        problems.append(f"{lost} requests never answered (e.g. {sample})")
    if duplicate_bound is not None and duplicated > duplicate_bound:
        problems.append(f"{duplicated} duplicate results, more than the bound {duplicate_bound}")
    return FaultReport(
        fault=fault,
        injections=injections,
        requests_in=len(ledger.sent),
        results_out=ledger.answered_count,
        lost=lost + events_lost,
        duplicated=duplicated + events_double,
        duplicate_bound=duplicate_bound,
        recovery_s=ledger.recovery_after(fault_end) if fault_end is not None else None,
        failures=problems,
        details={"outcomes": ledger.outcomes(), **(details or {})},
    )


async def _settle_answers(d: Deployment, sizes: ChaosSizes, linger_s: float = 2.0) -> None:
    """Wait for every sent request to be answered, then a little longer for late duplicates."""
    await d.traffic.flush()
    await d.collector.wait_answered(list(d.ledger.sent), sizes.answer_timeout_s)
    await asyncio.sleep(linger_s)


# -- the scenarios -----------------------------------------------------------------------


async def consumer_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL one of two consumers of the group while it computes a batch.

    The device is busy most of the time (long per-batch cost at this load), so
    the kill lands mid-batch. Every request must be answered; a duplicate is
    allowed only for a request the killed consumer answered after its last
    offset commit (at-least-once), and the row reports how many there were.
    """
    return await _consumer_kill(stage, sizes, transactional=False)


async def consumer_kill_transactional(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """The same SIGKILL with `kafka.transactional = true`: results and offsets commit together, no duplicates."""
    return await _consumer_kill(stage, sizes, transactional=True)


async def _consumer_kill(stage: Stage, sizes: ChaosSizes, *, transactional: bool) -> FaultReport:
    device = Device(a_ms=60.0, c_ms=3.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    async with Deployment(stage, device, partitions=4, transactional=transactional) as d:
        victim_id = "victim"
        d.consumer(victim_id)
        d.consumer("survivor")
        await d.warm_up(consumers=2)
        sending = asyncio.create_task(d.traffic.open_loop(sizes.requests, sizes.rate_rps))
        await asyncio.sleep(sizes.requests / sizes.rate_rps / 3)
        await _until_holding_work(d, victim_id)
        d.check_alive()
        fault_at = time.time()
        d.consumers[victim_id].kill()
        await asyncio.sleep(0.5)
        committed = await committed_offsets(d.settings, consumer_group(d.settings, CHAOS_MODEL))
        await sending
        await _settle_answers(d, sizes)
        d.check_alive()
        placement = d.traffic.placement
        exposed = {
            request_id
            for request_id, answers in d.ledger.results.items()
            if answers[0].consumer_id == victim_id
            and request_id in placement
            and placement[request_id][1] >= committed.get(placement[request_id][0], 0)
        }
        duplicated_ids = set(d.ledger.duplicated_ids())
        failures = []
        stray = duplicated_ids - exposed
        if stray:
            failures.append(f"{len(stray)} duplicates were not answered-but-uncommitted by the killed consumer")
        victim_partitions = {
            placement[request_id][0]
            for request_id, answers in d.ledger.results.items()
            if answers[0].consumer_id == victim_id and request_id in placement
        }
        reprocessed = sum(
            1
            for request_id, sent_at in d.ledger.sent.items()
            if sent_at < fault_at
            and request_id in placement
            and placement[request_id][0] in victim_partitions
            and request_id in d.ledger.results
            and d.ledger.results[request_id][0].consumer_id != victim_id
        )
        if reprocessed == 0:
            failures.append("the kill interrupted no work: nothing of the victim's partitions was left for the survivor")
        exposed_batches: dict[int | None, int] = {}
        for request_id in exposed:
            batch_id = d.ledger.results[request_id][0].batch_id
            exposed_batches[batch_id] = exposed_batches.get(batch_id, 0) + 1
        return _finish(
            d,
            "consumer SIGKILL mid-batch" + (" (transactions)" if transactional else ""),
            1,
            fault_end=fault_at,
            duplicate_bound=0 if transactional else len(exposed),
            failures=failures,
            details={
                "answered_uncommitted_by_victim": len(exposed),
                "victim_uncommitted_batch_sizes": sorted(exposed_batches.values(), reverse=True),
                "reprocessed_by_survivor": reprocessed,
            },
        )


async def poison_request(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """Requests that make the runner raise, each inside a batch of healthy ones.

    The consumer must bisect the batch: the healthy requests get `ok`
    results, each culprit an `error` result and a dead letter with reason
    `runner_error` and the runner's error text.
    """
    device = Device(a_ms=30.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=40.0)
    poison_every = 50
    async with Deployment(stage, device, partitions=2, poison_marker=POISON_MARKER) as d:
        d.consumer("only")
        await d.warm_up(consumers=1)
        count = max(100, sizes.requests // 3)

        def text_for(i: int) -> str:
            return f"{POISON_MARKER} request {i}" if i % poison_every == poison_every // 2 else f"healthy request {i}"

        ids = await d.traffic.open_loop(count, sizes.rate_rps * 2, text_for=text_for)
        fault_end = time.time()
        await _settle_answers(d, sizes, linger_s=1.0)
        d.check_alive()
        poison = [request_id for i, request_id in enumerate(ids) if POISON_MARKER in text_for(i)]
        healthy = sorted(set(ids) - set(poison))
        failures: list[str] = []
        for request_id in poison:
            letters = d.ledger.dead.get(request_id, [])
            if not any(l.reason == "runner_error" and "PoisonError" in l.detail for l in letters):
                failures.append(f"poison {request_id} has no runner_error dead letter naming the error")
            results = d.ledger.results.get(request_id, [])
            if not results or results[0].outcome != "error":
                failures.append(f"poison {request_id} did not get an `error` result")
        not_ok = [i for i in healthy if not d.ledger.results.get(i) or d.ledger.results[i][0].outcome != "ok"]
        if not_ok:
            failures.append(f"{len(not_ok)} healthy requests not answered ok (e.g. {not_ok[:3]})")
        batch_mates = _batch_mates(d, poison)
        if batch_mates == 0:
            failures.append("no poison request shared its batch with a healthy one: bisection untested")
        return _finish(
            d,
            "poison request (runner raises)",
            len(poison),
            fault_end=fault_end,
            failures=failures,
            details={"dead_lettered": sum(1 for p in poison if p in d.ledger.dead), "healthy_batch_mates_ok": batch_mates},
        )


def _batch_mates(d: Deployment, poison: list[str]) -> int:
    """Healthy requests answered `ok` from the very batch that held a poison request."""
    batches: dict[tuple[str | None, int | None], list[Answer]] = {}
    for answers in d.ledger.results.values():
        first = answers[0]
        if first.batch_id is not None:
            batches.setdefault((first.consumer_id, first.batch_id), []).append(first)
    mates = 0
    for request_id in poison:
        answers = d.ledger.results.get(request_id)
        if not answers or answers[0].batch_id is None:
            continue
        key = (answers[0].consumer_id, answers[0].batch_id)
        mates += sum(1 for other in batches.get(key, []) if other.outcome == "ok")
    return mates


async def overload(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """Arrivals at `overload_factor` x one consumer's capacity, every request with a deadline.

    The consumer must keep its memory bounded (Kafka holds the backlog, the
    fetch loop pauses), answer `expired` rather than run a request past its
    deadline, keep the latency of what it does run bounded, and drain the
    backlog once arrivals stop.
    """
    device = Device(a_ms=20.0, c_ms=4.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    rate = device.capacity_rps * sizes.overload_factor
    count = int(rate * sizes.overload_s)
    timeout_ms = sizes.overload_timeout_ms
    async with Deployment(
        stage, device, partitions=4, consumer={"max_queue": 256}, collect_latency_events=True
    ) as d:
        proc = d.consumer("only")
        await d.warm_up(consumers=1)
        baseline_rss = proc.rss_bytes()
        sampler = RssSampler([proc])
        sampler.start()
        started = time.time()
        await d.traffic.open_loop(count, rate, timeout_ms=timeout_ms)
        fault_end = time.time()
        await _settle_answers(d, sizes, linger_s=1.0)
        await sampler.stop()
        d.check_alive()
        ok = {rid: answers[0] for rid, answers in d.ledger.results.items() if answers[0].outcome == "ok"}
        e2e_ok = [float(a.done_ms - a.enqueue_ms) for a in ok.values()]
        late_bound_ms = timeout_ms + device.batch_ms(device.hard_cap) + 500.0
        slow = [x for x in e2e_ok if x > late_bound_ms]
        started_late = [
            rid for rid, a in ok.items() if d.ledger.dispatched_ms.get(rid, 0) > a.enqueue_ms + timeout_ms + DISPATCH_SLACK_MS
        ]
        untimed = [rid for rid in ok if rid not in d.ledger.dispatched_ms]
        p99 = percentile(e2e_ok, 99)
        in_window = [a for a in ok.values() if a.done_ms / 1000.0 <= fault_end]
        ok_rps = len(in_window) / max(fault_end - started, 1e-9)
        growth_mb = (sampler.peak_bytes - baseline_rss) / 2**20
        failures: list[str] = []
        outcomes = d.ledger.outcomes()
        if not outcomes.get("expired"):
            failures.append("no request was answered `expired` at 3x capacity")
        if started_late:
            failures.append(f"{len(started_late)} requests were dispatched after their deadline instead of expiring")
        if untimed:
            failures.append(f"{len(untimed)} ok results have no latency event to check their dispatch time")
        if p99 > late_bound_ms:
            failures.append(f"p99 of accepted requests {p99:.0f} ms above {late_bound_ms:.0f} ms")
        if growth_mb > 150:
            failures.append(f"consumer RSS grew {growth_mb:.0f} MB under overload (bound 150 MB)")
        if ok_rps < 0.5 * device.capacity_rps:
            failures.append(f"served {ok_rps:.0f} ok/s under overload, under half the capacity {device.capacity_rps:.0f}/s")
        return _finish(
            d,
            f"overload {sizes.overload_factor:g}x capacity for {sizes.overload_s:g} s",
            1,
            fault_end=fault_end,
            failures=failures,
            details={
                "capacity_rps": round(device.capacity_rps, 1),
                "offered_rps": round(rate, 1),
                "ok_rps_during": round(ok_rps, 1),
                "peak_rss_mb": round(sampler.peak_bytes / 2**20, 1),
                "rss_growth_mb": round(growth_mb, 1),
                "ok_p50_ms": round(percentile(e2e_ok, 50), 1),
                "ok_p99_ms": round(p99, 1),
                "ok_max_ms": round(max(e2e_ok, default=0.0), 1),
                "late_bound_ms": round(late_bound_ms, 1),
                "ok_over_late_bound": len(slow),
                "dispatched_after_deadline": len(started_late),
            },
        )


async def rebalance_storm(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """Consumers join and leave (SIGTERM) every few seconds while traffic flows.

    One consumer stays up throughout; around it others come and go, so the
    group rebalances again and again. The pace follows the guests, not a
    fixed clock: a new process needs seconds to start on a busy machine, so
    every `storm_period_s` the harness either stops the oldest guest that is
    serving (it has answered a request) or starts a new one. A leaving
    consumer finishes or abandons its work on revoke and commits only what it
    answered: nothing may be lost and, with clean leaves, nothing answered twice.
    """
    device = Device(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    async with Deployment(stage, device, partitions=6) as d:
        d.consumer("anchor")
        await d.warm_up(consumers=1)
        started = time.monotonic()
        storm_end, hard_end = started + sizes.storm_s, started + 2 * sizes.storm_s
        calm = asyncio.Event()
        sending = asyncio.create_task(
            d.traffic.open_loop(int(sizes.rate_rps * 2 * sizes.storm_s), sizes.rate_rps, until=calm.is_set)
        )
        guests: list[str] = []
        leaves = 0

        def storming() -> bool:
            """Until storm_s is over and (on a slow machine, up to twice as long) a join and a leave happened."""
            now = time.monotonic()
            joined = sum(1 for g in guests if _has_answered(d.ledger, g))
            return now < storm_end or (now < hard_end and (joined < 2 or leaves < 1))

        while storming():
            d.check_alive()
            serving = [g for g in guests if d.consumers[g].meant_up and _has_answered(d.ledger, g)]
            starting = [g for g in guests if d.consumers[g].meant_up and g not in serving]
            if len(serving) >= 2:
                d.consumers[serving[0]].request_stop()
                leaves += 1
            elif len(starting) < 2:
                name = f"guest{len(guests)}"
                d.consumer(name)
                guests.append(name)
            await asyncio.sleep(sizes.storm_period_s)
        fault_end = time.time()
        calm.set()
        await sending
        await _settle_answers(d, sizes)
        d.check_alive()
        answered_by: dict[str, int] = {}
        for answers in d.ledger.results.values():
            name = answers[0].consumer_id or "?"
            answered_by[name] = answered_by.get(name, 0) + 1
        joins = sum(1 for g in guests if g in answered_by)
        e2e = [float(a[0].done_ms - a[0].enqueue_ms) for a in d.ledger.results.values()]
        failures = []
        if joins < 2 or leaves < 1:
            failures.append(f"only {joins} guests served and {leaves} left ({answered_by}): no storm happened")
        return _finish(
            d,
            "rebalance storm (join/leave)",
            joins + leaves,
            fault_end=fault_end,
            failures=failures,
            details={
                "joins": joins,
                "leaves": leaves,
                "answered_by": answered_by,
                "e2e_p99_ms": round(percentile(e2e, 99), 1),
            },
        )


def _has_answered(ledger: Ledger, consumer_id: str) -> bool:
    return any(answers[0].consumer_id == consumer_id for answers in ledger.results.values())


async def _stop_sink_and_count(d: Deployment, sizes: ChaosSizes) -> tuple[int, int, dict[str, Any]]:
    """Wait for the sink to commit every latency event, stop it, and account for the rows."""
    await d.events_caught_up(sizes.answer_timeout_s)
    for sink in d.sinks:
        sink.terminate()
    return d.event_accounting(await d.clickhouse_rows())


async def _port_released(port: int, timeout_s: float = 30.0) -> None:
    """The stopped broker's listener port may linger a moment; the restart needs it free."""
    deadline = time.monotonic() + timeout_s
    while not port_is_free(port) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def broker_restart(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """Stop the broker for `outage_s` and start it again on the same data directory.

    Two consumers, the sink and the harness's own producer and reader are up
    throughout and must reconnect by themselves: every request answered,
    every latency event a ClickHouse row, none twice.
    """
    broker = stage.broker
    if broker is None:
        raise ChaosError("broker-restart needs a broker of its own (Stage.broker)")
    device = Device(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    before_s, after_s = 2.0, 3.0
    async with Deployment(stage, device, partitions=4) as d:
        d.consumer("c1")
        d.consumer("c2")
        d.sink()
        await d.warm_up(consumers=2)
        await d.sink_ready(sizes.answer_timeout_s)
        sending = asyncio.create_task(d.traffic.open_loop(int(sizes.rate_rps * (before_s + sizes.outage_s)), sizes.rate_rps))
        await asyncio.sleep(before_s)
        fault_start = time.time()
        try:
            await asyncio.to_thread(broker.stop)
            await asyncio.sleep(max(0.0, sizes.outage_s - (time.time() - fault_start)))
        finally:
            await _port_released(broker.port)
            await asyncio.to_thread(broker.start, 120.0)
        fault_end = time.time()
        await sending
        sending = asyncio.create_task(d.traffic.open_loop(int(sizes.rate_rps * after_s), sizes.rate_rps))
        target = await d.latency_end_offsets()
        caught_up = await d.events_caught_up(sizes.answer_timeout_s, target)
        await sending
        await _settle_answers(d, sizes)
        d.check_alive()
        events_lost, events_double, event_details = await _stop_sink_and_count(d, sizes)
        report = _finish(
            d,
            f"broker stopped {sizes.outage_s:g} s, restarted",
            1,
            fault_end=fault_end,
            duplicate_bound=None,
            events=(events_lost, events_double),
            details={
                "outage_s": round(fault_end - fault_start, 1),
                "events_recovery_s": None if caught_up is None else round(caught_up - fault_end, 1),
                **event_details,
            },
        )
        return report


async def sink_kill(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """SIGKILL the sink while events flow (`sink_kills` times), restarting it each time.

    Events inserted but not yet committed are delivered again to the new sink:
    every latency event must be a ClickHouse row, and none twice.
    """
    device = Device(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    kills = sizes.sink_kills
    async with Deployment(stage, device, partitions=4) as d:
        d.consumer("only")
        d.sink()
        await d.warm_up(consumers=1)
        await d.sink_ready(sizes.answer_timeout_s)
        sending = asyncio.create_task(d.traffic.open_loop(sizes.requests, sizes.rate_rps))
        gap_s = sizes.requests / sizes.rate_rps / (kills + 1)
        fault_end = time.time()
        for _ in range(kills):
            await asyncio.sleep(gap_s)
            d.check_alive()
            d.sinks[-1].kill()
            await asyncio.sleep(1.0)
            d.sink()
            fault_end = time.time()
        target = await d.latency_end_offsets()
        caught_up = await d.events_caught_up(sizes.answer_timeout_s, target)
        await sending
        await _settle_answers(d, sizes)
        d.check_alive()
        events_lost, events_double, event_details = await _stop_sink_and_count(d, sizes)
        failures = []
        if caught_up is None:
            failures.append("the restarted sink did not catch up with the events produced before its restart")
        report = _finish(
            d,
            "sink SIGKILL + restart",
            kills,
            fault_end=None,
            failures=failures,
            details=event_details,
            events=(events_lost, events_double),
        )
        report.recovery_s = None if caught_up is None else round(caught_up - fault_end, 2)
        return report


async def clickhouse_outage(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """ClickHouse refuses every insert for `outage_s` while traffic flows, then recovers.

    The running sink must retry by itself (no restart); inference must go on
    at full rate meanwhile; afterwards every latency event must be a row, none
    twice. The outage is injected with `StorageFreeze` (see there why).
    """
    device = Device(a_ms=10.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    before_s, after_s = 2.0, 4.0
    count = int(sizes.rate_rps * (before_s + sizes.outage_s + after_s))
    async with Deployment(stage, device, partitions=4, clickhouse={"insert_retry_max_s": 1.0}) as d:
        d.consumer("only")
        d.sink()
        await d.warm_up(consumers=1)
        await d.sink_ready(sizes.answer_timeout_s)
        sending = asyncio.create_task(d.traffic.open_loop(count, sizes.rate_rps))
        await asyncio.sleep(before_s)
        freeze = StorageFreeze(d.clickhouse_dir)
        try:
            freeze.freeze()
            outage_start = time.time()
            await asyncio.sleep(sizes.outage_s)
            d.check_alive()
            sink_members = await d.sink_members()
            stalled = await d.events_caught_up(0.5) is None
        finally:
            freeze.thaw()
        outage_end = time.time()
        target = await d.latency_end_offsets()
        caught_up = await d.events_caught_up(sizes.answer_timeout_s, target)
        await sending
        await _settle_answers(d, sizes)
        d.check_alive()
        events_lost, events_double, event_details = await _stop_sink_and_count(d, sizes)
        during = [rid for rid, at in d.ledger.sent.items() if outage_start <= at <= outage_end - 1.0]
        served_in_time = [
            rid for rid in during if d.ledger.results.get(rid) and d.ledger.results[rid][0].at <= outage_end
        ]
        e2e = {rid: float(a[0].done_ms - a[0].enqueue_ms) for rid, a in d.ledger.results.items()}
        p99_during = percentile([e2e[r] for r in during if r in e2e], 99)
        p99_outside = percentile(
            [e2e[r] for r, at in d.ledger.sent.items() if not outage_start <= at <= outage_end and r in e2e], 99
        )
        failures: list[str] = []
        if sink_members < 1:
            failures.append("the sink was not in its consumer group during the outage")
        if not stalled:
            failures.append("the sink caught up during the outage: ClickHouse did not really refuse inserts")
        if len(served_in_time) < 0.95 * len(during):
            failures.append(f"only {len(served_in_time)} of {len(during)} requests sent during the outage were served in it")
        if caught_up is None:
            failures.append("the sink did not load the outage's events after ClickHouse recovered")
        report = _finish(
            d,
            f"ClickHouse refusing inserts {sizes.outage_s:g} s",
            1,
            fault_end=None,
            failures=failures,
            events=(events_lost, events_double),
            details={
                "outage_s": round(outage_end - outage_start, 1),
                "served_during_outage": f"{len(served_in_time)}/{len(during)}",
                "e2e_p99_during_ms": round(p99_during, 1),
                "e2e_p99_outside_ms": round(p99_outside, 1),
                **event_details,
            },
        )
        report.recovery_s = None if caught_up is None else round(caught_up - outage_end, 2)
        return report

# -- the catalogue and a runner for `batchtide chaos` ------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Stage, ChaosSizes], Awaitable[FaultReport]]
    restarts_broker: bool = False
    """Stops the broker: must run on a broker nobody else uses."""


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("consumer-kill", consumer_kill),
        Scenario("consumer-kill-txn", consumer_kill_transactional),
        Scenario("broker-restart", broker_restart, restarts_broker=True),
        Scenario("clickhouse-outage", clickhouse_outage),
        Scenario("sink-kill", sink_kill),
        Scenario("poison", poison_request),
        Scenario("overload", overload),
        Scenario("rebalance-storm", rebalance_storm),
        Scenario("hostile-input", hostile_input),
    )
}


def _failed_setup(name: str, error: BaseException) -> FaultReport:
    return FaultReport(
        fault=name,
        injections=0,
        requests_in=0,
        results_out=0,
        lost=0,
        duplicated=0,
        duplicate_bound=None,
        recovery_s=None,
        failures=[f"harness error: {type(error).__name__}: {error}"],
    )


async def run_scenarios(names: list[str], sizes: ChaosSizes, workdir: Path) -> list[FaultReport]:
    """Run scenarios one after another on a private broker started in `workdir`."""
    broker = LocalKafka(workdir / "kafka")
    await asyncio.to_thread(broker.start, 120.0)
    reports: list[FaultReport] = []
    try:
        for name in names:
            scenario = SCENARIOS[name]
            stage = Stage(
                workdir=workdir / name,
                kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, topic_prefix=f"chaos-{name}-{uuid.uuid4().hex[:6]}"),
                broker=broker if scenario.restarts_broker else None,
            )
            stage.workdir.mkdir(parents=True, exist_ok=True)
            if not broker.is_running:
                await asyncio.to_thread(broker.start, 120.0)
            try:
                reports.append(await scenario.run(stage, sizes))
            except Exception as e:  # noqa: BLE001 - one broken scenario must not hide the others' rows
                reports.append(_failed_setup(name, e))
    finally:
        await asyncio.to_thread(broker.stop)
    return reports


def report_rows(reports: list[FaultReport]) -> list[dict[str, Any]]:
    """Plain dicts for `--json` (and for anyone who wants the table as data)."""
    return [
        {
            "fault": r.fault,
            "injections": r.injections,
            "requests_in": r.requests_in,
            "results_out": r.results_out,
            "lost": r.lost,
            "duplicated": r.duplicated,
            "duplicate_bound": r.duplicate_bound,
            "recovery_s": r.recovery_s,
            "passed": r.passed,
            "failures": r.failures,
            "details": r.details,
        }
        for r in reports
    ]
