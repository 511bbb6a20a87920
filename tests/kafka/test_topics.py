"""Topic layout and `ensure_topics`: names, partition counts, idempotence."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, client_options, ensure_topics


def test_topic_names_follow_the_documented_layout() -> None:
    topics = Topics("bt")
    assert topics.requests("minilm") == "bt.requests.minilm"
    assert topics.priority("minilm") == "bt.requests.minilm.priority"
    assert topics.results("minilm") == "bt.results.minilm"
    assert topics.latency_events == "bt.events.latency"
    assert topics.batch_events == "bt.events.batches"
    assert topics.dlq == "bt.dlq"
    assert topics.lag_events == "bt.events.lag"


async def _described(settings: KafkaSettings) -> dict[str, int]:
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        names = [n for n in await admin.list_topics() if n.startswith(settings.topic_prefix + ".")]
        return {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(names)}
    finally:
        await admin.close()


@pytest.mark.kafka
def test_ensure_topics_is_idempotent_and_grows_partitions(kafka_settings: KafkaSettings) -> None:
    settings = dataclasses.replace(kafka_settings, events_partitions=2)
    p = settings.topic_prefix
    expected = {
        f"{p}.requests.minilm": 3,
        f"{p}.requests.minilm.priority": 3,
        f"{p}.results.minilm": 3,
        f"{p}.requests.smollm": 1,
        f"{p}.requests.smollm.priority": 1,
        f"{p}.results.smollm": 1,
        f"{p}.events.latency": 2,
        f"{p}.events.batches": 2,
        f"{p}.events.lag": 2,
        f"{p}.dlq": 2,
        f"{p}.fleet": 1,
    }

    async def scenario() -> None:
        first = await ensure_topics(settings, {"minilm": 3, "smollm": 1})
        second = await ensure_topics(settings, {"minilm": 3, "smollm": 1})
        assert first == second == expected
        assert await _described(settings) == expected
        grown = await ensure_topics(settings, {"minilm": 5})
        assert grown[f"{p}.requests.minilm"] == 5
        assert grown[f"{p}.results.minilm"] == 5
        shrunk = await ensure_topics(settings, {"minilm": 2})
        assert shrunk[f"{p}.requests.minilm"] == 5, "an existing topic is never shrunk"

    asyncio.run(scenario())
