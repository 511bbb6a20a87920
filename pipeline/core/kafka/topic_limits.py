"""How large a record each topic takes: the broker's `max.message.bytes`, asked once per topic.

A record batch larger than its topic's `max.message.bytes` is refused by the
broker (MESSAGE_TOO_LARGE), and a refusal the consumer did not foresee used
to stop it. So before producing, the consumer asks the broker for each
topic's limit (DescribeConfigs, cached) and builds its answers and dead
letters to fit. When the broker cannot say (no DescribeConfigs permission, a
topic that does not exist yet), Kafka's default is assumed; a record the
broker still refuses is shrunk again by the delivery step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options

log = logging.getLogger("batchtide.consumer")

KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588
"""Kafka's default `message.max.bytes` (broker) and `max.message.bytes` (topic)."""
LOOKUP_TIMEOUT_S = 5.0
SAFETY_BYTES = 64
"""Kept free under a limit: the estimate below is exact today, this is for tomorrow's headers."""


def record_size(key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] | None) -> int:
    """Upper bound on the bytes one record takes as a batch of its own (what max.message.bytes limits)."""
    estimate: int = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers or ()))
    return estimate + SAFETY_BYTES


class TopicLimits:
    """`max.message.bytes` per topic, from the broker, cached for the consumer's lifetime."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self._kafka = kafka
        self._known: dict[str, int] = {}
        self._lock = asyncio.Lock()

    def cached(self, topic: str) -> int | None:
        return self._known.get(topic)

    def lower(self, topic: str, limit: int) -> None:
        """The broker refused a record we thought fit: trust a smaller limit from now on."""
        self._known[topic] = min(limit, self._known.get(topic, limit))

    async def limit(self, topic: str) -> int:
        known = self._known.get(topic)
        if known is not None:
            return known
        await self.prefetch([topic])
        return self._known[topic]

    async def prefetch(self, topics: Sequence[str]) -> None:
        """Ask the broker once for every topic not known yet."""
        async with self._lock:
            missing = [topic for topic in topics if topic not in self._known]
            if missing:
                self._known.update(await self._ask(missing))

    async def _ask(self, topics: list[str]) -> dict[str, int]:
        found = dict.fromkeys(topics, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
        admin = AIOKafkaAdminClient(request_timeout_ms=int(LOOKUP_TIMEOUT_S * 1000), **client_options(self._kafka))
        try:
            await asyncio.wait_for(admin.start(), LOOKUP_TIMEOUT_S)
            resources = [ConfigResource(ConfigResourceType.TOPIC, t, {"max.message.bytes": None}) for t in topics]
            responses = await asyncio.wait_for(admin.describe_configs(resources), LOOKUP_TIMEOUT_S)
        except Exception as e:
            log.warning("max.message.bytes of %s unknown (%r); assuming %d", topics, e, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
            return found
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        for response in responses:
            for error_code, _message, _type, name, entries in response.resources:
                if name not in found or error_code != 0:
                    continue
                for entry in entries:
                    if entry[0] == "max.message.bytes" and entry[1] is not None:
                        found[name] = int(entry[1])
        return found
