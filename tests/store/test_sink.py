"""The faust sink against a real Kafka broker and the real engine (chDB), in this process."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from clickhouse_connect.driver.client import Client

from pipeline.core.config import ClickHouseSettings, Config, KafkaSettings
from pipeline.core.kafka.client import Topics, client_options, create_topics
from pipeline.core.store.connection import ClickHouseUnavailable, connect, scalar_int
from pipeline.core.store.migrations import Layout
from pipeline.core.store.seed import batch_events, generate, latency_events, recent_start_ms
from pipeline.sink.app import Sink, build_sink, wait_until_ready
from pipeline.tools.harness.processes import Proc, sink_argv
from schemas.messages import BatchEvent, LatencyEvent

pytestmark = pytest.mark.kafka
ENCODE = msgspec.json.Encoder().encode


class Outage:
    """Test hook: while down, opening a ClickHouse client fails as an unreachable server would."""

    def __init__(self, settings: ClickHouseSettings, database: str) -> None:
        self.down = threading.Event()
        self._settings, self._database = settings, database

    def connect(self) -> Client:
        if self.down.is_set():
            raise ClickHouseUnavailable("test outage: ClickHouse unreachable")
        return connect(self._settings, database=self._database)


def _events(rows: int, seed: int) -> tuple[list[LatencyEvent], list[BatchEvent]]:
    chunks = list(generate(rows, seed=seed, start_ms=recent_start_ms(120_000), duration_ms=120_000))
    return [e for c in chunks for e in latency_events(c)], [b for c in chunks for b in batch_events(c)]


async def _produce(kafka: KafkaSettings, topic: str, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(**client_options(kafka), linger_ms=10, acks="all")
    await producer.start()
    try:
        for value in values:
            await producer.send(topic, value)
        await producer.flush()
    finally:
        await producer.stop()


async def _until(check: Callable[[], bool], timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s} s")
        await asyncio.sleep(0.1)


async def _committed(kafka: KafkaSettings, group: str) -> int:
    """Sum of the group's committed offsets over all partitions (0 when nothing is committed)."""
    admin = AIOKafkaAdminClient(**client_options(kafka))
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
        return sum(max(meta.offset, 0) for meta in offsets.values())
    finally:
        await admin.close()


def _sink_config(
    kafka: KafkaSettings, clickhouse: ClickHouseSettings, database: str, *, events_partitions: int, **knobs: Any
) -> Config:
    """A sink's config for one test: its own database, inserts every 200 ms unless `knobs` say otherwise."""
    return Config(
        kafka=dataclasses.replace(kafka, events_partitions=events_partitions),
        clickhouse=dataclasses.replace(clickhouse, **{"database": database, "insert_interval_ms": 200, **knobs}),
    )


@pytest.fixture
def sink_config(kafka_settings: KafkaSettings, clickhouse_settings: ClickHouseSettings, ch_database: str) -> Config:
    config = _sink_config(
        kafka_settings, clickhouse_settings, ch_database, events_partitions=2,
        insert_batch_size=400, max_buffer_events=100_000, insert_retry_max_s=0.5,
    )  # fmt: skip
    topics = Topics(config.kafka.topic_prefix)
    asyncio.run(create_topics(config.kafka, {topics.latency_events: 2, topics.batch_events: 2}))
    return config


def _counts(client: Client, database: str) -> tuple[int, int, int]:
    return (
        scalar_int(client, f"SELECT count() FROM {database}.request_latency"),
        scalar_int(client, f"SELECT count() FROM {database}.batches"),
        scalar_int(client, f"SELECT sum(requests) FROM {database}.latency_minute"),
    )


async def _running(sink: Sink, body: Callable[[], Awaitable[None]]) -> None:
    await sink.app.start()
    try:
        await body()
    finally:
        await sink.app.stop()
        sink.store.close()


def test_sink_loads_events_from_the_broker(sink_config: Config, clickhouse_client: Client, tmp_path: Path) -> None:
    db, topics = sink_config.clickhouse.database, Topics(sink_config.kafka.topic_prefix)
    latency, batches = _events(3_000, seed=21)
    outage = Outage(sink_config.clickhouse, db)
    sink = build_sink(sink_config, connect=outage.connect, datadir=str(tmp_path))

    async def scenario() -> None:
        await _produce(sink_config.kafka, topics.latency_events, [ENCODE(e) for e in latency] + [b"{not json"])
        await _produce(sink_config.kafka, topics.batch_events, [ENCODE(b) for b in batches])

        async def body() -> None:
            await _until(lambda: _counts(clickhouse_client, db)[:2] == (len(latency), len(batches)), what="all rows")
            await _until(lambda: sink.rejected == 1, what="garbage rejected")
            total = len(latency) + 1 + len(batches)
            deadline = time.monotonic() + 30
            while await _committed(sink_config.kafka, sink.app.conf.id) < total and time.monotonic() < deadline:
                await asyncio.sleep(0.3)
            assert await _committed(sink_config.kafka, sink.app.conf.id) == total

        await _running(sink, body)

    asyncio.run(scenario())
    stored = clickhouse_client.query(
        f"SELECT quantileExactInclusive(0.99)(e2e_ms), sum(tokens_in), uniqExact(request_id) FROM {db}.request_latency"
    ).result_rows[0]
    assert stored[0] == pytest.approx(np.quantile([e.e2e_ms for e in latency], 0.99), rel=1e-12)
    assert stored[1] == sum(e.tokens_in for e in latency) and stored[2] == len(latency)
    assert _counts(clickhouse_client, db)[2] == len(latency), "rollup fed once per request"


def test_redelivered_events_are_stored_once(sink_config: Config, clickhouse_client: Client, tmp_path: Path) -> None:
    db, topics = sink_config.clickhouse.database, Topics(sink_config.kafka.topic_prefix)
    latency, batches = _events(2_000, seed=22)
    sink = build_sink(sink_config, connect=Outage(sink_config.clickhouse, db).connect, datadir=str(tmp_path))

    async def scenario() -> None:
        values = [ENCODE(e) for e in latency]
        await _produce(sink_config.kafka, topics.latency_events, values + values[:1500])
        await _produce(sink_config.kafka, topics.batch_events, [ENCODE(b) for b in batches] * 2)

        async def body() -> None:
            await _until(lambda: sink.latency.stats.received == len(latency) + 1500 and sink.latency.buffered == 0
                         and sink.batches.stats.received == 2 * len(batches) and sink.batches.buffered == 0,
                         what="every copy consumed")  # fmt: skip

        await _running(sink, body)

    asyncio.run(scenario())
    assert _counts(clickhouse_client, db) == (len(latency), len(batches), len(latency))
    assert sink.latency.stats.duplicates == 1500 and sink.batches.stats.duplicates == len(batches)


def test_clickhouse_outage_loses_nothing_and_holds_offsets(
    sink_config: Config, clickhouse_client: Client, tmp_path: Path
) -> None:
    db, topics = sink_config.clickhouse.database, Topics(sink_config.kafka.topic_prefix)
    config = dataclasses.replace(
        sink_config, clickhouse=dataclasses.replace(sink_config.clickhouse, max_buffer_events=1_000)
    )
    latency, batches = _events(4_000, seed=23)
    first, second = latency[:1_000], latency[1_000:]
    outage = Outage(config.clickhouse, db)
    sink = build_sink(config, connect=outage.connect, datadir=str(tmp_path))

    async def scenario() -> None:
        await _produce(config.kafka, topics.latency_events, [ENCODE(e) for e in first])

        async def body() -> None:
            await _until(lambda: _counts(clickhouse_client, db)[0] == len(first), what="first half stored")
            await _until(lambda: sink.lag()["uncommitted"] == 0, what="first half committed")
            committed_before = await _committed(config.kafka, sink.app.conf.id)
            outage.down.set()
            sink.store.close()  # the engine handle goes away under the sink: inserts now fail for real
            await _produce(config.kafka, topics.latency_events, [ENCODE(e) for e in second])
            await _produce(config.kafka, topics.batch_events, [ENCODE(b) for b in batches])
            await _until(lambda: sink.latency.buffered == config.clickhouse.max_buffer_events, what="buffer full")
            await asyncio.sleep(1.5)  # commit interval is 1 s: nothing un-inserted may be committed meanwhile
            assert sink.latency.buffered == config.clickhouse.max_buffer_events, "bounded: consuming stops when full"
            assert sink.latency.stats.failures > 0 and sink.latency.stats.failing_since is not None
            assert sink.lag()["unread"] > 0, "backpressure leaves the rest in Kafka"
            assert _counts(clickhouse_client, db)[0] == len(first)
            assert await _committed(config.kafka, sink.app.conf.id) == committed_before
            outage.down.clear()
            await _until(lambda: _counts(clickhouse_client, db)[:2] == (len(latency), len(batches)), what="catch-up")

        await _running(sink, body)

    asyncio.run(scenario())
    assert _counts(clickhouse_client, db) == (len(latency), len(batches), len(latency))


def test_sink_restarted_during_an_outage_replays_without_duplicates(
    sink_config: Config, clickhouse_client: Client, tmp_path: Path
) -> None:
    db, topics = sink_config.clickhouse.database, Topics(sink_config.kafka.topic_prefix)
    latency, batches = _events(2_500, seed=24)
    outage = Outage(sink_config.clickhouse, db)

    async def scenario() -> None:
        await _produce(sink_config.kafka, topics.latency_events, [ENCODE(e) for e in latency])
        await _produce(sink_config.kafka, topics.batch_events, [ENCODE(b) for b in batches])
        first = build_sink(sink_config, connect=outage.connect, datadir=str(tmp_path / "a"))

        async def half_stored_then_down() -> None:
            await _until(lambda: _counts(clickhouse_client, db)[0] >= 400, what="some rows stored")
            outage.down.set()
            first.store.close()
            await _until(lambda: first.latency.stats.failures > 0, what="inserts failing")

        await _running(first, half_stored_then_down)
        assert _counts(clickhouse_client, db)[0] < len(latency)
        outage.down.clear()
        second = build_sink(sink_config, connect=outage.connect, datadir=str(tmp_path / "b"))

        async def catch_up() -> None:
            await _until(lambda: _counts(clickhouse_client, db)[:2] == (len(latency), len(batches)), what="all rows")
            await asyncio.sleep(1.0)

        await _running(second, catch_up)

    asyncio.run(scenario())
    assert _counts(clickhouse_client, db) == (len(latency), len(batches), len(latency))


def test_sink_authenticates_with_sasl(
    sasl_kafka_settings: KafkaSettings, clickhouse_settings: ClickHouseSettings, ch_database: str,
    clickhouse_client: Client, tmp_path: Path,
) -> None:  # fmt: skip
    """The sink reaches a SASL-only broker with the same KafkaSettings every other client uses."""
    config = _sink_config(sasl_kafka_settings, clickhouse_settings, ch_database, events_partitions=1)
    kafka, clickhouse, topics = config.kafka, config.clickhouse, Topics(config.kafka.topic_prefix)
    latency, _ = _events(300, seed=25)
    sink = build_sink(config, connect=Outage(clickhouse, ch_database).connect, datadir=str(tmp_path))

    async def scenario() -> None:
        await create_topics(kafka, {topics.latency_events: 1, topics.batch_events: 1})
        await _produce(kafka, topics.latency_events, [ENCODE(e) for e in latency])

        async def body() -> None:
            await _until(lambda: _counts(clickhouse_client, ch_database)[0] == len(latency), what="rows via SASL")

        await _running(sink, body)

    asyncio.run(scenario())
    assert _counts(clickhouse_client, ch_database)[0] == len(latency)


def test_sink_started_while_clickhouse_and_kafka_are_down_waits_and_loses_nothing(
    sink_config: Config, clickhouse_client: Client, tmp_path: Path, kafka_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """No supervisor needed: start-up waits with backoff, says for what, then stores every event."""
    db, topics = sink_config.clickhouse.database, Topics(sink_config.kafka.topic_prefix)
    latency, batches = _events(1_000, seed=24)
    outage = Outage(sink_config.clickhouse, db)
    caplog.set_level(logging.INFO, logger="batchtide.sink")

    async def scenario() -> None:
        await _produce(sink_config.kafka, topics.latency_events, [ENCODE(e) for e in latency])
        await _produce(sink_config.kafka, topics.batch_events, [ENCODE(b) for b in batches])
        outage.down.set()
        await asyncio.to_thread(kafka_broker.stop)
        ready = asyncio.create_task(
            wait_until_ready(sink_config, Layout(db), connect=outage.connect, first_s=0.1, max_s=0.5)
        )
        await asyncio.sleep(1.5)
        assert not ready.done() and "sink waiting for ClickHouse" in caplog.text
        outage.down.clear()
        await _until(lambda: "sink waiting for Kafka at" in caplog.text, timeout_s=30, what="waiting for Kafka")
        assert not ready.done()
        await asyncio.to_thread(kafka_broker.start, 90)
        await asyncio.wait_for(ready, 60)
        assert "is back after" in caplog.text
        sink = build_sink(sink_config, connect=outage.connect, datadir=str(tmp_path))

        async def body() -> None:
            await _until(lambda: _counts(clickhouse_client, db)[:2] == (len(latency), len(batches)), what="all rows")

        await _running(sink, body)

    asyncio.run(scenario())
    assert _counts(clickhouse_client, db)[:2] == (len(latency), len(batches))


def test_batchtide_sink_started_without_a_broker_keeps_waiting_and_says_so(tmp_path: Path) -> None:
    """The command itself: no broker on the configured address, and it neither exits nor stays silent."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free once closed: nothing listens there
    config = tmp_path / "batchtide.toml"
    config.write_text(
        f'[kafka]\nbootstrap_servers = "127.0.0.1:{port}"\ntopic_prefix = "nobroker"\n'
        f'[clickhouse]\ndata_dir = "{tmp_path / "clickhouse"}"\n'
    )
    child = Proc("sink", sink_argv(config), tmp_path)
    child.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.log_text().count("sink waiting for Kafka") < 2:
            assert child.alive, child.log_tail()
            time.sleep(0.2)
        assert child.alive
    finally:
        child.kill()
    text = child.log_text()
    assert f"sink waiting for Kafka at 127.0.0.1:{port}" in text and "next try in" in text, text[-2000:]
