"""Delivery when the broker keeps failing past the producer's own retries (a short request timeout
stands in for a long outage): answers move off a broken reply topic, the pipeline's own records
wait and go through once their topic is back. Nothing raises to the consumer."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from consumers.answers import Answers
from consumers.delivery import Delivery
from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, client_options, create_topics
from pipeline.core.kafka.outbox import BATCH_BYTES, Message, Outbox
from pipeline.core.kafka.topic_limits import TopicLimits
from tests.support.kafka import consume_n

pytestmark = pytest.mark.kafka

REQUEST_TIMEOUT_MS = 3000


async def _delivery(kafka: KafkaSettings, own: set[str], fallback: str) -> tuple[AIOKafkaProducer, Outbox, Delivery]:
    producer = AIOKafkaProducer(
        **client_options(kafka), request_timeout_ms=REQUEST_TIMEOUT_MS, max_batch_size=BATCH_BYTES, acks="all"
    )
    await producer.start()
    limits = TopicLimits(kafka)
    outbox = Outbox(producer, set(), limits)
    outbox.start()
    return producer, outbox, Delivery(producer, outbox, limits, own, fallback)


def test_a_reply_topic_deleted_under_the_consumer_gets_its_answers_rerouted(kafka_settings: KafkaSettings) -> None:
    topics = Topics(kafka_settings.topic_prefix)
    results = topics.results("m")
    reply = f"{kafka_settings.topic_prefix}-client.answers"

    async def scenario() -> Delivery:
        await create_topics(kafka_settings, {results: 1, reply: 1})
        producer, outbox, delivery = await _delivery(kafka_settings, {results}, results)
        answers = Answers("m", "c1", topics, TopicLimits(kafka_settings))
        try:
            await delivery.deliver([answers.result("first", reply, "ok", enqueue_ms=1, done_ms=2)])
            admin = AIOKafkaAdminClient(**client_options(kafka_settings))
            await admin.start()
            try:
                await admin.delete_topics([reply])
            finally:
                await admin.close()
            second = answers.result("second", reply, "ok", enqueue_ms=1, done_ms=2)
            await asyncio.wait_for(delivery.deliver([second]), 6 * REQUEST_TIMEOUT_MS / 1000)
        finally:
            await outbox.stop()
            await producer.stop()
        return delivery

    delivery = asyncio.run(scenario())
    (record,) = asyncio.run(consume_n(kafka_settings, results, 1))
    moved = json.loads(record.value)
    assert (
        moved["id"] == "second"
        and moved["outcome"] == "ok"
        and moved["reply_error"].startswith(f"reply_topic {reply!r}")
    )
    assert delivery.rebuilt == 1


def test_an_own_topic_missing_past_the_retries_is_waited_for_and_loses_nothing(kafka_settings: KafkaSettings) -> None:
    dlq = Topics(kafka_settings.topic_prefix).dlq

    async def scenario() -> Delivery:
        producer, outbox, delivery = await _delivery(kafka_settings, {dlq}, dlq)
        try:
            sending = asyncio.create_task(delivery.deliver([Message(dlq, b"k", b"held until the topic exists")]))
            while delivery.retries == 0:
                assert not sending.done(), sending
                await asyncio.sleep(0.1)
            await create_topics(kafka_settings, {dlq: 1})
            await asyncio.wait_for(sending, 60)
        finally:
            await outbox.stop()
            await producer.stop()
        return delivery

    delivery = asyncio.run(scenario())
    records = asyncio.run(consume_n(kafka_settings, dlq, 1))
    assert [r.value for r in records] == [b"held until the topic exists"]
    assert delivery.retries >= 1
