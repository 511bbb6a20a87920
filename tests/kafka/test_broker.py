"""The local broker is a real Kafka: TCP round trips, restarts keep state, transactions work."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import UnknownTopicOrPartitionError

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options, create_topics
from pipeline.tools.devtools.localkafka import LocalKafka, port_is_free
from tests.support.kafka import consume_n, json_values, produce_json


@pytest.mark.kafka
def test_round_trip_over_tcp(kafka_broker: LocalKafka, kafka_settings: KafkaSettings) -> None:
    topic = f"{kafka_settings.topic_prefix}.roundtrip"
    values = [{"i": i, "text": f"hello {i}"} for i in range(200)]

    async def scenario() -> list[object]:
        await create_topics(kafka_settings, {topic: 3})
        sent = await produce_json(kafka_settings, topic, values, key=lambda v: v["i"])
        assert {m.partition for m in sent} == {0, 1, 2}
        return json_values(await consume_n(kafka_settings, topic, len(values)))

    received = asyncio.run(scenario())
    assert sorted(received, key=lambda v: v["i"]) == values  # type: ignore[index]
    assert kafka_broker.bootstrap.startswith("127.0.0.1:")
    assert kafka_broker.log_file.stat().st_size > 0
    console = (kafka_broker.data_dir / "broker.out").read_text()
    assert "INFO" not in console, "broker logs must go to the log file, not the console"


@pytest.mark.kafka
def test_restart_keeps_topics_messages_and_committed_offsets(
    kafka_broker: LocalKafka, kafka_settings: KafkaSettings
) -> None:
    topic = f"{kafka_settings.topic_prefix}.durable"
    group = f"{kafka_settings.topic_prefix}.group"
    values = [{"n": n} for n in range(10)]

    async def before() -> None:
        await create_topics(kafka_settings, {topic: 1})
        await produce_json(kafka_settings, topic, values)
        first = await consume_n(kafka_settings, topic, 6, group_id=group)
        assert json_values(first) == values[:6]

    asyncio.run(before())
    bootstrap = kafka_broker.bootstrap
    kafka_broker.stop()
    assert not kafka_broker.is_running
    assert port_is_free(kafka_broker.port)

    kafka_broker.start()
    assert kafka_broker.bootstrap == bootstrap

    async def after() -> None:
        counts = await create_topics(kafka_settings, {topic: 1})
        assert counts == {topic: 1}
        rest = await consume_n(kafka_settings, topic, 4, group_id=group)
        assert json_values(rest) == values[6:], "the group must resume from its committed offset"
        everything = await consume_n(kafka_settings, topic, 10)
        assert json_values(everything) == values

    asyncio.run(after())


@pytest.mark.kafka
def test_messages_survive_sigkill(kafka_broker: LocalKafka, kafka_settings: KafkaSettings) -> None:
    topic = f"{kafka_settings.topic_prefix}.crash"
    values = [{"n": n} for n in range(50)]

    async def produce() -> None:
        await create_topics(kafka_settings, {topic: 2})
        await produce_json(kafka_settings, topic, values)

    asyncio.run(produce())
    kafka_broker.kill()
    assert not kafka_broker.is_running
    kafka_broker.start()
    received = asyncio.run(consume_n(kafka_settings, topic, len(values)))
    assert sorted(json_values(received), key=lambda v: v["n"]) == values


@pytest.mark.kafka
def test_transactions_commit_is_visible_and_abort_is_not(kafka_settings: KafkaSettings) -> None:
    topic = f"{kafka_settings.topic_prefix}.txn"

    async def scenario() -> tuple[list[object], list[object]]:
        await create_topics(kafka_settings, {topic: 1})
        producer = AIOKafkaProducer(
            **client_options(kafka_settings), transactional_id=f"{kafka_settings.topic_prefix}.tx"
        )
        await producer.start()
        try:
            async with producer.transaction():
                for n in range(3):
                    await producer.send(topic, json.dumps({"txn": "committed", "n": n}).encode())
            await producer.begin_transaction()
            for n in range(2):
                await producer.send(topic, json.dumps({"txn": "aborted", "n": n}).encode())
            await producer.abort_transaction()
            async with producer.transaction():
                await producer.send(topic, json.dumps({"txn": "last", "n": 0}).encode())
        finally:
            await producer.stop()
        committed = await consume_n(kafka_settings, topic, 4, isolation_level="read_committed")
        uncommitted = await consume_n(kafka_settings, topic, 6, isolation_level="read_uncommitted")
        return json_values(committed), json_values(uncommitted)

    committed, uncommitted = asyncio.run(scenario())
    assert [v["txn"] for v in committed] == ["committed"] * 3 + ["last"]  # type: ignore[index]
    assert [v["txn"] for v in uncommitted] == ["committed"] * 3 + ["aborted"] * 2 + ["last"]  # type: ignore[index]


@pytest.mark.kafka
def test_topic_auto_creation_is_off(kafka_settings: KafkaSettings) -> None:
    """Topics are created explicitly; a typo in a topic name must not create a new topic."""
    topic = f"{kafka_settings.topic_prefix}.never-created"

    async def scenario() -> list[str]:
        consumer = AIOKafkaConsumer(**client_options(kafka_settings))
        await consumer.start()
        try:
            await consumer._client.force_metadata_update()
            producer = AIOKafkaProducer(**client_options(kafka_settings), request_timeout_ms=2000)
            await producer.start()
            try:
                with pytest.raises(UnknownTopicOrPartitionError):
                    await asyncio.wait_for(producer.send(topic, b"x"), timeout=5)
            finally:
                await producer.stop()
            return sorted(await consumer.topics())
        finally:
            await consumer.stop()

    assert topic not in asyncio.run(scenario())


_START_FROM_A_THREAD = """
import sys, threading
from pipeline.tools.devtools.localkafka import LocalKafka
broker = LocalKafka(sys.argv[1])
starter = threading.Thread(target=broker.start, args=(90.0,))
starter.start()
starter.join()
print(broker.pid, flush=True)
threading.Event().wait()
"""


@pytest.mark.kafka
@pytest.mark.timeout(150)
def test_a_broker_ends_with_the_process_that_started_it_even_from_a_thread(tmp_path: Path) -> None:
    """SIGKILL of the starting process (no atexit runs) still stops the broker, also when a
    worker thread started it, as `bench pipeline` does (asyncio.to_thread)."""
    starter = subprocess.Popen(
        [sys.executable, "-c", _START_FROM_A_THREAD, str(tmp_path / "kafka")],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
        text=True,
    )
    try:
        assert starter.stdout is not None
        pid = int(starter.stdout.readline())
        assert psutil.pid_exists(pid)
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 60
    while (
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, (
        "the broker outlived its starter"
    )
