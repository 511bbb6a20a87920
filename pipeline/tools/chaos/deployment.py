"""One fault scenario's pipeline: a cost-model device, its consumers and sink as real processes,
the traffic with known ids and the ledger that accounts for every one of them.

Built from the shared end-to-end harness (`pipeline.tools.harness`); what is
chaos's own is the ledger and the questions a scenario asks of the events
path: has the sink caught up, how many rows did it store.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, ensure_topics, stable_group_size
from pipeline.tools.chaos.ledger import Ledger
from pipeline.tools.devtools.localcluster import LocalCluster
from pipeline.tools.devtools.localkafka import LocalKafka
from pipeline.tools.harness.config_file import kafka_table, toml_text
from pipeline.tools.harness.errors import HarnessError
from pipeline.tools.harness.events import stored_rows
from pipeline.tools.harness.group_offsets import (
    admin_client,
    committed_offsets,
    consumer_group,
    end_offsets,
    wait_group,
    wait_share_group,
)
from pipeline.tools.harness.open_loop import Traffic
from pipeline.tools.harness.processes import Proc, Processes
from pipeline.tools.harness.results import Collector

CHAOS_MODEL = "chaos"


@dataclass(frozen=True)
class CostModelDevice:
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


class Deployment:
    """One scenario's pipeline: its config file, consumer and sink processes, and the harness clients.

    Use as `async with Deployment(...) as d:`; every process it started is
    stopped on the way out, also when the scenario fails.
    """

    def __init__(
        self,
        stage: Stage,
        device: CostModelDevice,
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
        self._consumer_table = dict(consumer or {})
        self.partitions = partitions
        self.settings = stage.kafka
        self.topics = Topics(stage.kafka.topic_prefix)
        self.clickhouse_dir = stage.workdir / "clickhouse"
        self.processes = Processes(stage.workdir / "logs")
        self.log_dir = self.processes.log_dir
        self.consumers: dict[str, Proc] = self.processes.consumers
        self.sinks: list[Proc] = self.processes.sinks
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
        self.config_path = self.write_config(
            "config.toml",
            {
                "kafka": kafka_table(stage.kafka, transactional=transactional),
                "clickhouse": {"data_dir": str(self.clickhouse_dir), "insert_interval_ms": 300.0, **(clickhouse or {})},
                "consumer": dict(consumer or {}),
                f"models.{CHAOS_MODEL}": model,
            },
        )
        self.ledger = Ledger()
        self.run_id = uuid.uuid4().hex[:8]
        self.collector = Collector(stage.kafka, CHAOS_MODEL, self.ledger, latency_events=collect_latency_events)
        self.traffic = Traffic(stage.kafka, CHAOS_MODEL, self.ledger, self.run_id)
        self._sink_group_id: str | None = None

    def write_config(self, name: str, tables: dict[str, dict[str, Any]]) -> Path:
        path = self.stage.workdir / name
        path.write_text(toml_text(tables))
        return path

    async def __aenter__(self) -> Deployment:
        await ensure_topics(self.settings, {CHAOS_MODEL: self.partitions})
        await self.collector.start()
        await self.traffic.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.processes.stop(timeout_s=10)
        try:
            await self.traffic.stop()
        finally:
            await self.collector.stop()

    # -- processes --

    def consumer(self, consumer_id: str, env: dict[str, str] | None = None) -> Proc:
        """Start a consumer process of the model's group (a new process on every call), with `env` added
        to its environment."""
        return self.processes.consumer(CHAOS_MODEL, self.config_path, consumer_id, env=env)

    def sink(self, config_path: Path | None = None, name: str = "sink") -> Proc:
        """Start a sink process (`batchtide sink`) on the deployment's config."""
        return self.processes.sink(config_path or self.config_path, name)

    def check_alive(self) -> None:
        """Raise if a process the scenario did not stop has died (a crash is not a fault we injected)."""
        proc = self.processes.crashed()
        if proc is not None:
            raise HarnessError(f"{proc.name} exited unexpectedly; its log ends:\n{proc.log_tail()}")

    async def warm_up(self, consumers: int = 1, timeout_s: float = 90.0) -> None:
        """Return once `consumers` processes are in the group and answering requests."""
        deadline = time.monotonic() + timeout_s
        await self.wait_group_size(consumers, deadline - time.monotonic())
        ids = [await self.traffic.send("warm-up", warmup=True) for _ in range(max(4, 2 * self.partitions))]
        await self.traffic.flush()
        if not await self.collector.wait_answered(ids, max(5.0, deadline - time.monotonic())):
            self.check_alive()
            raise HarnessError(f"warm-up requests not answered within {timeout_s} s")
        for request_id in ids:
            self.ledger.sent.pop(request_id, None)

    @property
    def share(self) -> bool:
        """The consumers run in a share group (`[consumer] group_type = "share"`)."""
        return self._consumer_table.get("group_type") == "share"

    async def wait_group_size(self, members: int, timeout_s: float) -> None:
        if self.share:
            group = self.topics.share_group(CHAOS_MODEL)
            await wait_share_group(self.settings, group, members, timeout_s, check=self.check_alive, poll_s=0.3)
            return
        group = consumer_group(self.settings, CHAOS_MODEL)
        await wait_group(self.settings, group, members, timeout_s, check=self.check_alive, poll_s=0.3)

    # -- events in ClickHouse --

    async def latency_end_offsets(self) -> dict[tuple[str, int], int]:
        """Offsets after the last latency event of each partition now: what the sink must have committed
        to be caught up (below the log end when transactions wrote the events: see `end_offsets`)."""
        return await end_offsets(self.settings, self.topics.latency_events)

    async def events_caught_up(
        self, timeout_s: float, target: dict[tuple[str, int], int] | None = None
    ) -> float | None:
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
            except Exception:
                pass
            await asyncio.sleep(0.3)
        return None

    async def sink_ready(self, timeout_s: float) -> None:
        """Return once the sink has stored and committed the warm-up's events."""
        if await self.events_caught_up(timeout_s) is None:
            raise HarnessError(f"the sink did not commit the warm-up events within {timeout_s:.0f} s")

    async def _sink_group(self) -> str | None:
        """The sink's consumer group: the deployment's group that is not the model's consumers'.

        Found by asking the broker rather than by knowing the sink's app id, so
        the harness keeps working whatever the sink names its group.
        """
        if self._sink_group_id is not None:
            return self._sink_group_id
        # the broker lists share groups beside consumer groups (Kafka 4): the model's share group is not the sink's
        own = {consumer_group(self.settings, CHAOS_MODEL), self.topics.share_group(CHAOS_MODEL)}
        admin = await admin_client(self.settings)
        try:
            names = [g[0] for g in await admin.list_consumer_groups()]
        finally:
            await admin.close()
        ours = [n for n in names if n.startswith(self.settings.topic_prefix) and n not in own]
        if len(ours) == 1:
            self._sink_group_id = ours[0]
        return self._sink_group_id

    async def sink_members(self) -> int:
        group = await self._sink_group()
        return 0 if group is None else await stable_group_size(self.settings, group)

    async def clickhouse_rows(self) -> dict[str, Any]:
        """Latency rows per request id, read from the embedded store (no sink may be running)."""
        if any(p.alive for p in self.sinks):
            raise HarnessError("stop the sink before reading its embedded ClickHouse directory")
        return await stored_rows(self.clickhouse_dir)

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
