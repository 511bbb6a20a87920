"""The consumer's Kafka clients, built in the order they depend on each other.

The producer comes first (transactional, with an id stable across restarts
so a successor fences its predecessor, when `KafkaSettings.transactional`)
with its outbox; then the size limits of the topics the consumer writes;
then the group consumer (`read_committed` under transactions, so aborted
answers are never read back), the publisher that ties producer and
consumer, the membership guard that lets a transaction commit offsets only
while the group membership is fresh (`fencing.py`), what starts newly assigned partitions at
their stable commit points (`stable_start.py`), the fetcher and its watchdog (`fetch_watchdog.py`: a fetch stuck
on a broker that stopped answering). Closing takes what the stop budget gives each
client (aiokafka can wait forever for a broker that is gone).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from consumers.clock import Clock
from consumers.delivery import Delivery
from consumers.fencing import MembershipGuard
from consumers.fetch_watchdog import FetchWatchdog
from consumers.fetcher import Fetcher
from consumers.publish import Publisher
from consumers.sharing import ShareIntake, SharePublisher
from consumers.stable_start import StableStart
from consumers.stats import ConsumerStats
from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options, durable_producer, stop_client
from pipeline.core.kafka.outbox import BATCH_BYTES, Outbox
from pipeline.core.kafka.topic_limits import TopicLimits
from pipeline.core.kafka.txn_offset_commit import fence_txn_offsets


@dataclass
class KafkaClients:
    producer: AIOKafkaProducer
    outbox: Outbox
    consumer: AIOKafkaConsumer
    publisher: Publisher
    fetcher: Fetcher
    watchdog: FetchWatchdog
    stable_start: StableStart

    async def stop_consumer(self, name: str, timeout_s: float) -> None:
        await self.watchdog.stop()
        await self.stable_start.stop()
        await stop_client(self.consumer.stop, f"{name}: the Kafka consumer", timeout_s)

    async def stop_producer(self, name: str, timeout_s: float) -> None:
        await self.outbox.stop()
        await stop_client(self.producer.stop, f"{name}: the Kafka producer", timeout_s)


@dataclass
class ShareClients:
    """The clients of a consumer in share mode: the same producer; share members instead of a group consumer."""

    producer: AIOKafkaProducer
    outbox: Outbox
    publisher: SharePublisher
    fetcher: ShareIntake

    async def stop_consumer(self, name: str, timeout_s: float) -> None:
        await self.fetcher.close(timeout_s)

    async def stop_producer(self, name: str, timeout_s: float) -> None:
        await self.outbox.stop()
        await stop_client(self.producer.stop, f"{name}: the Kafka producer", timeout_s)


@dataclass(frozen=True)
class ClientPlan:
    """What a consumer's clients are built from, whatever its group type."""

    kafka: KafkaSettings
    group_id: str
    consumer_id: str
    shared_topics: frozenset[str]
    own_topics: frozenset[str]
    results_topic: str
    priority_topic: str
    limits: TopicLimits
    max_queue: int
    stats: ConsumerStats
    clock: Clock


async def _producer(plan: ClientPlan, transactional_id: str | None) -> tuple[AIOKafkaProducer, Outbox, Delivery]:
    kafka, limits = plan.kafka, plan.limits
    producer_options: dict[str, Any] = dict(
        linger_ms=0, max_batch_size=BATCH_BYTES, request_timeout_ms=kafka.request_timeout_ms, **durable_producer()
    )
    if transactional_id is not None:
        producer_options["transactional_id"] = transactional_id
    producer = AIOKafkaProducer(**client_options(kafka), **producer_options)
    await producer.start()
    outbox = Outbox(producer, set(plan.shared_topics), limits)
    outbox.start()
    delivery = Delivery(producer, outbox, limits, set(plan.own_topics), plan.results_topic, plan.clock)
    await limits.prefetch(sorted(plan.own_topics))
    return producer, outbox, delivery


async def open_share_clients(
    plan: ClientPlan, *, request_topic: str, members: int, max_records: int, may_pull: Callable[[], int]
) -> ShareClients:
    producer, outbox, delivery = await _producer(plan, None)
    intake = ShareIntake(
        plan.kafka,
        group_id=plan.group_id,
        consumer_id=plan.consumer_id,
        request_topic=request_topic,
        priority_topic=plan.priority_topic,
        members=members,
        max_records=max_records,
        max_queue=plan.max_queue,
        stats=plan.stats,
        may_pull=may_pull,
    )
    await intake.open()
    return ShareClients(producer, outbox, SharePublisher(delivery, intake, plan.stats), intake)


async def open_clients(plan: ClientPlan) -> KafkaClients:
    kafka, group_id, stats, clock = plan.kafka, plan.group_id, plan.stats, plan.clock
    options = client_options(kafka)
    producer, outbox, delivery = await _producer(
        plan, f"{group_id}.{plan.consumer_id}" if kafka.transactional else None
    )
    consumer = AIOKafkaConsumer(
        **options,
        group_id=group_id,
        client_id=plan.consumer_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed" if kafka.transactional else "read_uncommitted",
        max_partition_fetch_bytes=1024 * 1024,
        request_timeout_ms=kafka.request_timeout_ms,
    )
    await consumer.start()
    guard = MembershipGuard(clock)
    guard.attach(consumer)
    if kafka.transactional:
        fence_txn_offsets(producer, guard.member)
    publisher = Publisher(
        transactional=kafka.transactional,
        group_id=group_id,
        producer=producer,
        consumer=consumer,
        outbox=outbox,
        delivery=delivery,
        stats=stats,
        guard=guard,
    )
    stable_start = StableStart(consumer, publisher.tracker, group_id, stats, clock)
    fetcher = Fetcher(consumer, plan.priority_topic, plan.max_queue, stats, stable_start.holding)
    watchdog = FetchWatchdog(consumer, stats, clock)
    watchdog.start()
    return KafkaClients(producer, outbox, consumer, publisher, fetcher, watchdog, stable_start)
