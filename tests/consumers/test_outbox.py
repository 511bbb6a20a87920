"""The outbox against the real broker: one refused record fails alone, never its batch mates."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options
from pipeline.core.kafka.outbox import BATCH_BYTES, Message, Outbox
from pipeline.core.kafka.topic_limits import KAFKA_DEFAULT_MAX_MESSAGE_BYTES, TopicLimits
from tests.consumers.harness import configure_topic
from tests.support.kafka import consume_n

pytestmark = pytest.mark.kafka


def test_a_batch_refused_as_too_large_is_resent_record_by_record(kafka_settings: KafkaSettings) -> None:
    """The broker's limit is lower than the one cached: the 50 KB batch is refused, its 1 KB
    records then go one per batch, and only the record that is too large on its own fails."""
    topic = f"{kafka_settings.topic_prefix}.small"
    small = [Message(topic, f"k{i}".encode(), b"x" * 1000) for i in range(50)]
    big = Message(topic, b"big", b"y" * 30_000)

    async def scenario() -> list[BaseException | None]:
        await configure_topic(kafka_settings, topic, {}, partitions=1)
        limits = TopicLimits(kafka_settings)
        assert await limits.limit(topic) == KAFKA_DEFAULT_MAX_MESSAGE_BYTES
        await configure_topic(kafka_settings, topic, {"max.message.bytes": "20000"})  # the cache is stale now
        await asyncio.sleep(1.0)  # the broker applies topic configs asynchronously
        producer = AIOKafkaProducer(**client_options(kafka_settings), max_batch_size=BATCH_BYTES, acks="all")
        await producer.start()
        try:
            outbox = Outbox(producer, set(), limits)
            return await outbox.send_all([*small[:25], big, *small[25:]])
        finally:
            await producer.stop()

    errors = asyncio.run(scenario())
    assert isinstance(errors[25], MessageSizeTooLargeError)
    assert errors[:25] + errors[26:] == [None] * 50
    stored = asyncio.run(consume_n(kafka_settings, topic, 50, timeout_s=30))
    assert sorted(r.key or b"" for r in stored) == sorted(m.key or b"" for m in small)
