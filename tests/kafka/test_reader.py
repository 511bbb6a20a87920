"""The one topic reader: aborted answers are never counted, and each stop condition stops it."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaProducer

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options, create_topics
from pipeline.core.kafka.reader import Record, TopicReader
from tests.support.kafka import produce_json

pytestmark = pytest.mark.kafka


async def _aborted_then_committed(settings: KafkaSettings, topic: str) -> None:
    """Three answers in a transaction that aborts, then two in one that commits (a consumer
    killed mid-transaction and its successor, as seen on the result topic)."""
    producer = AIOKafkaProducer(**client_options(settings), transactional_id=f"t-{uuid.uuid4().hex[:8]}")
    await producer.start()
    try:
        await producer.begin_transaction()
        for i in range(3):
            await producer.send_and_wait(topic, f"aborted-{i}".encode())
        await producer.abort_transaction()
        await producer.begin_transaction()
        for i in range(2):
            await producer.send_and_wait(topic, f"committed-{i}".encode())
        await producer.commit_transaction()
    finally:
        await producer.stop()


def test_aborted_answers_are_not_read_by_default(kafka_settings: KafkaSettings) -> None:
    topic = f"{kafka_settings.topic_prefix}.results.m"

    async def scenario() -> tuple[list[bytes], list[bytes]]:
        await create_topics(kafka_settings, {topic: 1})
        await _aborted_then_committed(kafka_settings, topic)
        committed: list[bytes] = []
        async with TopicReader(kafka_settings, topic) as reader:
            await reader.read(lambda r: committed.append(r.value), idle_s=2.0, timeout_s=30)
        everything: list[bytes] = []
        async with TopicReader(kafka_settings, topic, isolation_level="read_uncommitted") as reader:
            await reader.read(lambda r: everything.append(r.value), idle_s=2.0, timeout_s=30)
        return committed, everything

    committed, everything = asyncio.run(scenario())
    assert committed == [b"committed-0", b"committed-1"]
    assert sorted(everything) == sorted([b"aborted-0", b"aborted-1", b"aborted-2", b"committed-0", b"committed-1"])


def test_stop_conditions(kafka_settings: KafkaSettings) -> None:
    topic = f"{kafka_settings.topic_prefix}.results.m"

    async def scenario() -> None:
        await create_topics(kafka_settings, {topic: 1})
        await produce_json(kafka_settings, topic, [{"id": f"r{i}"} for i in range(10)], partition=0)
        seen: list[Record] = []
        async with TopicReader(kafka_settings, topic) as reader:
            assert await reader.read(seen.append, limit=4, timeout_s=30)
        assert len(seen) == 4, "a limit never fetches beyond it"

        seen.clear()
        async with TopicReader(kafka_settings, topic) as reader:
            started = time.monotonic()
            met = await reader.read(seen.append, until=lambda: len(seen) >= 3, grace_s=1.0, timeout_s=30)
            assert met and time.monotonic() - started >= 1.0
        assert len(seen) == 10, "records arriving in the grace are read too"

        seen.clear()
        async with TopicReader(kafka_settings, topic) as reader:
            assert not await reader.read(seen.append, until=lambda: len(seen) > 10, timeout_s=3)
        assert len(seen) == 10, "a timeout returns False after reading what there was"

        async with TopicReader(kafka_settings, topic, from_beginning=False) as reader:
            started = time.monotonic()
            assert not await reader.read(seen.append, idle_s=1.0, timeout_s=30)
            assert time.monotonic() - started < 20, "idle_s ends a quiet read long before the timeout"
        assert len(seen) == 10, "reading from the end sees none of the old records"

    asyncio.run(scenario())
