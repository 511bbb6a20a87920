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

from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from consumers.clock import Clock
from consumers.delivery import Delivery
from consumers.fencing import MembershipGuard
from consumers.fetch_watchdog import FetchWatchdog
from consumers.fetcher import Fetcher
from consumers.publish import Publisher
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


async def open_clients(
    kafka: KafkaSettings,
    *,
    group_id: str,
    consumer_id: str,
    shared_topics: set[str],
    own_topics: set[str],
    results_topic: str,
    priority_topic: str,
    limits: TopicLimits,
    max_queue: int,
    stats: ConsumerStats,
    clock: Clock,
) -> KafkaClients:
    options = client_options(kafka)
    producer_options: dict[str, Any] = dict(
        linger_ms=0, max_batch_size=BATCH_BYTES, request_timeout_ms=kafka.request_timeout_ms, **durable_producer()
    )
    if kafka.transactional:
        producer_options["transactional_id"] = f"{group_id}.{consumer_id}"
    producer = AIOKafkaProducer(**options, **producer_options)
    await producer.start()
    outbox = Outbox(producer, shared_topics, limits)
    outbox.start()
    delivery = Delivery(producer, outbox, limits, own_topics, results_topic, clock)
    await limits.prefetch(sorted(own_topics))
    consumer = AIOKafkaConsumer(
        **options,
        group_id=group_id,
        client_id=consumer_id,
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
    fetcher = Fetcher(consumer, priority_topic, max_queue, stats, stable_start.holding)
    watchdog = FetchWatchdog(consumer, stats, clock)
    watchdog.start()
    return KafkaClients(producer, outbox, consumer, publisher, fetcher, watchdog, stable_start)
