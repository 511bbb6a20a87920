"""`LocalKafka.restart_after`: the broker goes away and comes back on the same address;
clients that lived through the outage recover by themselves and nothing is lost."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options, create_topics
from pipeline.tools.devtools.localkafka import LocalKafka

pytestmark = pytest.mark.kafka


@pytest.mark.parametrize("hard", [False, True], ids=["sigterm", "sigkill"])
def test_clients_ride_through_a_broker_outage(
    kafka_broker: LocalKafka, kafka_settings: KafkaSettings, hard: bool
) -> None:
    topic = f"{kafka_settings.topic_prefix}.outage"
    group = f"{kafka_settings.topic_prefix}.group"
    outage_s = 3.0

    async def scenario() -> tuple[list[int], float, float]:
        await create_topics(kafka_settings, {topic: 2})
        producer = AIOKafkaProducer(**client_options(kafka_settings), acks="all", request_timeout_ms=60_000)
        consumer = AIOKafkaConsumer(
            topic,
            **client_options(kafka_settings),
            group_id=group,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await producer.start()
        await consumer.start()
        seen: list[int] = []

        async def read_until(count: int) -> None:
            deadline = time.monotonic() + 60
            while len(seen) < count and time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=500)
                for records in batch.values():
                    seen.extend(json.loads(r.value)["n"] for r in records)
                if batch:
                    await consumer.commit()

        try:
            await asyncio.gather(*[await producer.send(topic, json.dumps({"n": n}).encode()) for n in range(50)])
            await read_until(50)
            outage = kafka_broker.restart_after(outage_s, hard=hard)
            assert not kafka_broker.is_running
            during = [await producer.send(topic, json.dumps({"n": n}).encode()) for n in range(50, 100)]
            await asyncio.gather(*during)
            await read_until(100)
            downtime = await asyncio.wrap_future(outage)
            return seen, downtime, outage_s
        finally:
            await consumer.stop()
            await producer.stop()

    seen, downtime, outage_s = asyncio.run(scenario())
    assert sorted(seen) == list(range(100)), "nothing lost, nothing duplicated"
    assert downtime >= outage_s
    assert kafka_broker.is_running
