"""Running consumers inside a test's event loop, and reading their answers back.

Everything talks to the session's real broker; nothing here fakes Kafka.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from consumers.clock import Clock
from consumers.delivery import Delivery
from consumers.fencing import MembershipGuard
from consumers.publish import Publisher
from consumers.runners import make_runner
from consumers.stats import ConsumerStats
from consumers.worker import Consumer
from pipeline.core.config import BatchProfile, ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.core.engine import BatchingEngine
from pipeline.core.kafka.client import Topics, client_options, ensure_topics
from pipeline.core.kafka.outbox import Outbox
from pipeline.core.kafka.reader import Isolation, Record, TopicReader
from pipeline.core.kafka.topic_limits import TopicLimits
from pipeline.tools.harness.group_offsets import committed_offsets as group_offsets
from tests.support.kafka import produce_json

MODEL = "m"


def cost_model(
    *, a_ms: float = 1.0, c_ms: float = 0.05, partitions: int = 4, poison: str | None = None, **profile: Any
) -> ModelConfig:
    """A simulated device that costs a + c*b ms per batch."""
    return ModelConfig(
        name=MODEL,
        runner="cost-model",
        cost_a_ms=a_ms,
        cost_c_ms=c_ms,
        partitions=partitions,
        poison_marker=poison,
        profile=BatchProfile(**profile),
    )


def make_consumer(
    model: ModelConfig, kafka: KafkaSettings, settings: ConsumerSettings | None = None, name: str = "c1"
) -> Consumer:
    return Consumer(
        model,
        kafka,
        settings or ConsumerSettings(commit_interval_ms=50),
        runner=make_runner(model),
        engine=BatchingEngine(model.profile),
        consumer_id=name,
    )


async def create_topics(kafka: KafkaSettings, model: ModelConfig) -> None:
    await ensure_topics(kafka, {model.name: model.partitions})


async def configure_topic(kafka: KafkaSettings, name: str, configs: dict[str, str], *, partitions: int = 1) -> None:
    """Create `name` with topic-level `configs`, or set them on it if it exists."""
    admin = AIOKafkaAdminClient(**client_options(kafka))
    await admin.start()
    try:
        response = await admin.create_topics([NewTopic(name, partitions, 1, topic_configs=configs)])
        if any(entry[1] for entry in response.topic_errors):
            await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, name, configs)])
    finally:
        await admin.close()


async def produce_raw(kafka: KafkaSettings, topic: str, value: bytes, *, key: bytes | None = None) -> int:
    """Produce one record of any size the broker takes; returns its offset."""
    producer = AIOKafkaProducer(**client_options(kafka), acks="all", max_request_size=len(value) + 64 * 1024)
    await producer.start()
    try:
        return (await producer.send_and_wait(topic, value, key=key)).offset
    finally:
        await producer.stop()


@asynccontextmanager
async def running(consumer: Consumer) -> AsyncIterator[Consumer]:
    """The consumer serving in the background; stopped cleanly (drain, commit) on exit."""
    await consumer.start()
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        yield consumer
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


@asynccontextmanager
async def serving(
    model: ModelConfig, kafka: KafkaSettings, settings: ConsumerSettings | None = None, name: str = "c1"
) -> AsyncIterator[Consumer]:
    """The model's topics created and one consumer serving them, as most consumer tests start."""
    await create_topics(kafka, model)
    async with running(make_consumer(model, kafka, settings, name)) as consumer:
        yield consumer


def request(i: int, prefix: str = "r", **fields: Any) -> dict[str, Any]:
    return {"id": f"{prefix}{i}", "model": MODEL, "text": f"hello number {i}", **fields}


async def send(
    kafka: KafkaSettings,
    topic: str,
    values: Iterable[dict[str, Any] | bytes | None],
    *,
    partition: int | None = None,
    headers: list[tuple[str, bytes]] | None = None,
) -> None:
    """Produce records keyed by request id (raw bytes and None are sent as they are, unkeyed)."""
    await produce_json(
        kafka,
        topic,
        values,
        key=lambda value: value["id"] if isinstance(value, dict) else None,
        partition=partition,
        headers=headers,
    )


class Answers:
    """Everything a topic received, grouped by request id, with arrival times."""

    def __init__(self) -> None:
        self.by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.received_ms: dict[str, float] = {}
        self.order: list[str] = []

    def add(self, value: dict[str, Any], key: str) -> None:
        self.by_id[key].append(value)
        if key not in self.received_ms:
            self.received_ms[key] = time.time() * 1000.0
            self.order.append(key)

    @property
    def duplicates(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.by_id.items() if len(v) > 1}


async def collect(
    kafka: KafkaSettings,
    topic: str,
    ids: set[str],
    *,
    timeout_s: float = 60.0,
    grace_s: float = 0.5,
    key_field: str = "id",
    isolation_level: Isolation = "read_committed",
) -> Answers:
    """Read `topic` from the start until every id in `ids` arrived (plus `grace_s` for duplicates)."""
    answers = Answers()

    def add(record: Record) -> None:
        value = json.loads(record.value)
        answers.add(value, value.get(key_field) or "")

    async with TopicReader(kafka, topic, isolation_level=isolation_level) as reader:
        await reader.read(add, until=lambda: ids <= answers.by_id.keys(), grace_s=grace_s, timeout_s=timeout_s)
    return answers


async def committed_offsets(kafka: KafkaSettings, topic: str, partitions: int, group: str) -> dict[int, int]:
    """The group's committed offset of each of `topic`'s partitions (0 where it committed none)."""
    committed = await group_offsets(kafka, group)
    return {p: committed.get((topic, p), 0) for p in range(partitions)}


async def poll_records(consumer: Any, count: int, *, polls: int = 60) -> list[Any]:
    """The first `count` records a started, subscribed aiokafka consumer fetches (or what came in
    `polls` half-second polls: the caller asserts the count)."""
    records: list[Any] = []
    for _ in range(polls):
        records += [r for batch in (await consumer.getmany(timeout_ms=500)).values() for r in batch]
        if len(records) >= count:
            break
    return records


def hand_publisher(
    kafka: KafkaSettings,
    producer: AIOKafkaProducer,
    consumer: AIOKafkaConsumer,
    group: str,
    answers: str,
    clock: Clock,
    stats: ConsumerStats,
    *,
    transactional: bool = True,
) -> tuple[Publisher, Outbox, MembershipGuard]:
    """A publisher wired as the consumer's loop wires it (its outbox running, a membership guard on
    the started `consumer`), for a test that drives answers and commits by hand; the caller stops
    the outbox."""
    limits = TopicLimits(kafka)
    outbox = Outbox(producer, set(), limits)
    outbox.start()
    guard = MembershipGuard(clock)
    guard.attach(consumer)
    publisher = Publisher(
        transactional=transactional,
        group_id=group,
        producer=producer,
        consumer=consumer,
        outbox=outbox,
        delivery=Delivery(producer, outbox, limits, {answers}, answers, clock),
        stats=stats,
        guard=guard,
    )
    return publisher, outbox, guard


async def take_records(publisher: Publisher, consumer: AIOKafkaConsumer, tp: Any, count: int) -> list[Any]:
    """The first `count` records of the subscribed `consumer`, received by `publisher` as the loop
    receives them once the member has joined."""
    records = await poll_records(consumer, count)
    assert len(records) == count
    publisher.joined()
    for record in records:
        publisher.tracker.received(tp, record.offset)
    return records


async def read_committed(kafka: KafkaSettings, topic: str) -> list[str]:
    """Every committed record's value on `topic` (read_committed, from the start), after a short drain."""
    reader = AIOKafkaConsumer(
        topic, **client_options(kafka), group_id=None, auto_offset_reset="earliest", isolation_level="read_committed"
    )
    await reader.start()
    try:
        out: list[str] = []
        for _ in range(6):
            out += [r.value.decode() for b in (await reader.getmany(timeout_ms=500)).values() for r in b]
        return out
    finally:
        await reader.stop()


def topics(kafka: KafkaSettings) -> Topics:
    return Topics(kafka.topic_prefix)
