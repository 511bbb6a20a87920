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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from pipeline.chaos.ledger import EventTally, Ledger
from pipeline.core.config import KafkaSettings
from pipeline.devtools.localcluster import LocalCluster
from pipeline.devtools.localkafka import LocalKafka, port_is_free
from pipeline.core.kafka.client import Topics, client_options, durable_producer, ensure_topics, stable_group_size
from pipeline.core.kafka.reader import Record, TopicReader
from schemas.messages import DeadLetter, LatencyEvent, Request, Result


CHAOS_MODEL = "chaos"

SINK_ENV = {"BROKER_SESSION_TIMEOUT": "10"}
"""faust reads its settings from the environment too. Its default session timeout
(60 s) makes a crashed sink's partitions wait a minute before a restarted sink
may take them; the harness deploys the sink as an operator should, with the
same 10 s the consumers' aiokafka default uses."""

REPO_ROOT = Path(__file__).resolve().parents[2]


class ChaosError(RuntimeError):
    """The harness could not set up or drive a scenario (not a verdict on the pipeline)."""


class Collector:
    """Reads the results and DLQ topics (and optionally the latency events) from the start into
    a Ledger, surviving broker restarts."""

    def __init__(self, settings: KafkaSettings, model: str, ledger: Ledger, *, latency_events: bool = False) -> None:
        topics = Topics(settings.topic_prefix)
        self._results_topic = topics.results(model)
        self._dlq_topic = topics.dlq
        self._latency_topic = topics.latency_events
        self._ledger = ledger
        self._reader = TopicReader(
            settings,
            [self._results_topic, self._dlq_topic, *([self._latency_topic] if latency_events else [])],
            request_timeout_ms=30_000,
        )
        self._task: asyncio.Task[bool] | None = None
        self._result_decoder = msgspec.json.Decoder(Result)
        self._dead_decoder = msgspec.json.Decoder(DeadLetter)
        self._latency_decoder = msgspec.json.Decoder(LatencyEvent)

    async def start(self) -> None:
        await self._reader.start()
        self._task = asyncio.create_task(self._reader.read(self._record, poll_ms=200))

    def _record(self, record: Record) -> None:
        if record.value is None:
            return
        if record.topic == self._results_topic:
            self._ledger.record_result(self._result_decoder.decode(record.value), time.time())
        elif record.topic == self._latency_topic:
            self._ledger.record_timing(self._latency_decoder.decode(record.value))
        else:
            self._ledger.record_dead(self._dead_decoder.decode(record.value), time.time())

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
        await stop_task(self._task)
        await self._reader.stop()


class Traffic:
    """Open-loop producer of requests with known ids: sends on schedule, never waits for answers."""

    def __init__(self, settings: KafkaSettings, model: str, ledger: Ledger, run_id: str) -> None:
        self._topic = Topics(settings.topic_prefix).requests(model)
        self._model = model
        self._ledger = ledger
        self._run_id = run_id
        self._next = 0
        self._producer = AIOKafkaProducer(
            **durable_producer(),
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

    async def send(
        self, text: str = "chaos", *, timeout_ms: int | None = None, request_id: str | None = None, warmup: bool = False
    ) -> str:
        request_id = request_id or self.new_id()
        req = Request(id=request_id, model=self._model, text=text, timeout_ms=timeout_ms, warmup=warmup)
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

    def wait(self, timeout_s: float) -> int | None:
        """The exit code once the process ends, or None if it is still running after `timeout_s`."""
        if self._popen is None:
            return None
        try:
            return self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

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


_COUNT_ROWS = """
import json, sys
from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.client import connect
client = connect(ClickHouseSettings(data_dir=sys.argv[1]), database=sys.argv[2])
raw = client.query("SELECT request_id, count() FROM request_latency GROUP BY request_id").result_rows
final = client.query("SELECT count() FROM request_latency FINAL").result_rows[0][0]
print(json.dumps({"raw_per_id": {r[0]: r[1] for r in raw}, "final_rows": final}))
"""
"""Run in a child process: chDB lets one process open a data directory, and the
harness may need several directories in one run."""


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
    cluster: LocalCluster | None = None
    """A cluster owned by this stage (the cluster rows kill, freeze and restart its nodes), or None."""


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
        ids = [await self.traffic.send("warm-up", warmup=True) for _ in range(max(4, 2 * self.partitions))]
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
        """Offsets after the last latency event of each partition now: what the sink must have committed
        to be caught up (below the log end when transactions wrote the events: see `end_offsets`)."""
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
        """(events lost, events double-counted, details) against every request that was answered
        (refused ones too: a `rejected` answer has its event).

        Double-counted is judged on the raw table, not FINAL: the per-minute
        rollups see every inserted row, so the sink must not insert one twice."""
        per_id: dict[str, int] = rows["raw_per_id"]
        expected = set(self.ledger.results)
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
    """{(topic, partition): offset after its last data record} of every partition of `topic`
    (the log end, unless transaction markers end the log)."""
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
        tps = [TopicPartition(topic, p) for p in partitions]
        ends = await consumer.end_offsets(tps)
        data_ends = await _last_data_offsets(consumer, ends)
    finally:
        await consumer.stop()
    return {(tp.topic, tp.partition): offset for tp, offset in data_ends.items()}


DATA_LOOKBACK = 64
"""How far below a partition's end `_last_data_offsets` looks for its last record."""


async def _last_data_offsets(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
    """Offset after each partition's last data record, which is below the log end when the log
    ends in transaction markers (a transactional producer wrote it). A consumer never sees a
    marker, so a caught-up consumer commits this offset, not the end; waiting for the end would
    wait forever. The last DATA_LOOKBACK offsets are read to find it (the end if none is there)."""
    wanted = {tp: end for tp, end in ends.items() if end > 0}
    found = dict(ends)
    if not wanted:
        return found
    consumer.assign(list(wanted))
    starts = await consumer.beginning_offsets(list(wanted))
    last: dict[TopicPartition, int] = {}
    for tp, end in wanted.items():
        consumer.seek(tp, max(end - DATA_LOOKBACK, starts.get(tp, 0)))
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        batches = await consumer.getmany(timeout_ms=200)
        for tp, records in batches.items():
            for record in records:
                if record.offset < wanted[tp]:
                    last[tp] = record.offset + 1
        positions = {tp: await consumer.position(tp) for tp in wanted}
        if all(positions[tp] >= end for tp, end in wanted.items()):
            break
    for tp, end in wanted.items():
        found[tp] = last.get(tp, end)
    return found


@dataclass(frozen=True)
class ChaosSizes:
    """How long and how hard each scenario pushes. `quick()` is what the test suite uses."""

    rate_rps: float = 80.0
    """Steady arrival rate of the scenarios that are not about overload."""
    requests: int = 1600
    """Requests of the steady scenarios (duration = requests / rate)."""
    outage_s: float = 20.0
    """How long the broker, or ClickHouse, stays away."""
    freeze_s: float = 30.0
    """How long `broker-freeze` keeps a cluster's broker SIGSTOPped."""
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
        return cls(rate_rps=60.0, requests=600, outage_s=10.0, freeze_s=8.0, overload_s=15.0, sink_kills=1,
                   storm_s=20.0, storm_period_s=2.0, answer_timeout_s=90.0)  # fmt: skip


async def settle_answers(d: Deployment, sizes: ChaosSizes, linger_s: float = 2.0) -> None:
    """Wait for every sent request to be answered, then a little longer for late duplicates."""
    await d.traffic.flush()
    await d.collector.wait_answered(list(d.ledger.sent), sizes.answer_timeout_s)
    await asyncio.sleep(linger_s)


async def drain_events(d: Deployment, sizes: ChaosSizes, sending: asyncio.Task[Any]) -> EventTally:
    """After a fault on the events path: wait for the sink to catch up with what was produced so
    far, let the traffic finish and every answer arrive, then stop the sink and count its rows."""
    target = await d.latency_end_offsets()
    caught_up = await d.events_caught_up(sizes.answer_timeout_s, target)
    await sending
    await settle_answers(d, sizes)
    d.check_alive()
    await d.events_caught_up(sizes.answer_timeout_s)
    for sink in d.sinks:
        sink.terminate()
    lost, double, details = d.event_accounting(await d.clickhouse_rows())
    return EventTally(caught_up, lost, double, details)


async def port_released(port: int, timeout_s: float = 30.0) -> None:
    """A stopped broker's listener port may linger a moment; its restart needs it free."""
    deadline = time.monotonic() + timeout_s
    while not port_is_free(port) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it is gone."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
