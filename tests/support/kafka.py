"""Kafka fixtures: one real local broker per test session, plus a SASL one on demand.

`kafka_broker` is session-scoped; a test may stop or kill it (fault tests do)
and the next test finds it running again. `kafka_settings` gives each test its
own topic prefix, so tests never see each other's records.

Helpers `produce_json` and `consume_n` are plain coroutines; call them with
`asyncio.run(...)` from a sync test or `await` them inside one.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, RecordMetadata

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options
from pipeline.core.kafka.reader import Isolation, TopicReader
from pipeline.tools.devtools.localkafka import LocalKafka

SASL_USERS = {"batchtide": "s3cret-test"}
"""Users of the SASL broker (test-only credentials)."""

_session_brokers: list[LocalKafka] = []


def _start(broker: LocalKafka) -> LocalKafka:
    broker.start(timeout_s=90)
    _session_brokers.append(broker)
    return broker


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A real single-node KRaft broker on a free loopback port, shared by the session."""
    broker = _start(LocalKafka(tmp_path_factory.mktemp("kafka")))
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def sasl_kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A second broker whose only client listener is SASL_PLAINTEXT (PLAIN, SCRAM-SHA-256)."""
    broker = _start(LocalKafka(tmp_path_factory.mktemp("kafka-sasl"), sasl_users=SASL_USERS))
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def tls_kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A broker whose only client listener is SASL_SSL (certificate signed by a CA in its data dir)."""
    broker = _start(LocalKafka(tmp_path_factory.mktemp("kafka-tls"), sasl_users=SASL_USERS, tls=True))
    yield broker
    broker.stop()


@pytest.fixture(autouse=True)
def _restart_stopped_brokers(request: pytest.FixtureRequest) -> None:
    """A test that stopped or killed a session broker must not break the `kafka` tests after it
    (the others need no broker: it restarts before the next one that does)."""
    if request.node.get_closest_marker("kafka") is None:
        return
    for broker in _session_brokers:
        if not broker.is_running:
            broker.start(timeout_s=90)


def unique_prefix(name: str) -> str:
    """A topic prefix unique to one test: readable test name plus a random suffix."""
    readable = re.sub(r"[^a-zA-Z0-9_-]+", "-", name)[:40].strip("-")
    return f"t-{readable}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def kafka_settings(kafka_broker: LocalKafka, request: pytest.FixtureRequest) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=kafka_broker.bootstrap, topic_prefix=unique_prefix(request.node.name))


def _secured(
    broker: LocalKafka, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, **security: Any
) -> KafkaSettings:
    """Settings for a secured broker; the password is set in the environment, as in production."""
    user, password = next(iter(SASL_USERS.items()))
    monkeypatch.setenv("BATCHTIDE_KAFKA_PASSWORD", password)
    return KafkaSettings(
        bootstrap_servers=broker.bootstrap,
        topic_prefix=unique_prefix(request.node.name),
        sasl_username=user,
        **security,
    )


@pytest.fixture
def sasl_kafka_settings(
    sasl_kafka_broker: LocalKafka, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> KafkaSettings:
    """SASL_PLAINTEXT with PLAIN."""
    return _secured(sasl_kafka_broker, request, monkeypatch, security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN")


@pytest.fixture
def tls_kafka_settings(
    tls_kafka_broker: LocalKafka, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> KafkaSettings:
    """SASL_SSL: SCRAM-SHA-256 and the broker's CA."""
    return _secured(
        tls_kafka_broker, request, monkeypatch,
        security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256", ssl_cafile=str(tls_kafka_broker.ca_file),
    )  # fmt: skip


async def produce_json(
    settings: KafkaSettings,
    topic: str,
    values: Iterable[Any],
    *,
    key: Any = None,
    partition: int | None = None,
    headers: list[tuple[str, bytes]] | None = None,
) -> list[RecordMetadata]:
    """Produce each value as a JSON record (acks=all) and return where each landed.

    Bytes and None are sent as they are (hostile input); `key` is a value or a
    function of the value, None for no key.
    """
    producer = AIOKafkaProducer(**client_options(settings), acks="all")
    await producer.start()
    try:
        futures = []
        for value in values:
            record_key = key(value) if callable(key) else key
            raw = value if value is None or isinstance(value, bytes) else json.dumps(value).encode()
            futures.append(
                await producer.send(
                    topic,
                    raw,
                    key=None if record_key is None else str(record_key).encode(),
                    partition=partition,
                    headers=headers,
                )
            )
        return list(await asyncio.gather(*futures))
    finally:
        await producer.stop()


async def consume_n(
    settings: KafkaSettings,
    topics: str | Iterable[str],
    n: int,
    *,
    timeout_s: float = 30.0,
    group_id: str | None = None,
    isolation_level: Isolation = "read_committed",
) -> list[ConsumerRecord[bytes, bytes]]:
    """Read `n` records from the beginning of `topics`; fail if they do not arrive in time.

    Without `group_id` nothing is committed. With one, the group's offsets are
    committed after the read, so a second call continues where this one stopped.
    """
    records: list[ConsumerRecord[bytes, bytes]] = []
    async with TopicReader(settings, topics, group_id=group_id, isolation_level=isolation_level) as reader:
        if not await reader.read(records.append, limit=n, timeout_s=timeout_s):
            raise TimeoutError(f"got {len(records)} of {n} records from {reader.topics} in {timeout_s} s")
        if group_id is not None:
            await reader.commit()
    return records


def json_values(records: Iterable[ConsumerRecord[bytes, bytes]]) -> list[Any]:
    return [json.loads(r.value) for r in records if r.value is not None]
