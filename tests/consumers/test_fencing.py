"""Self-fencing: a transaction carries offsets only while the group membership is fresh.

The rule runs on plain numbers; the publisher runs against the real broker with a clock the
test moves, so that a membership goes stale without waiting out a real session.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from consumers.fencing import NO_GENERATION, MembershipGuard, stale
from consumers.stats import ConsumerStats
from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options, create_topics, durable_producer
from pipeline.core.kafka.outbox import Message
from tests.consumers.harness import hand_publisher, read_committed, take_records
from tests.support.clock import FakeClock
from tests.support.kafka import produce_json


def test_the_rule_refuses_a_stale_heartbeat_a_moved_generation_and_no_membership() -> None:
    assert stale(10.0, 8.0, 3, 3, 3, session_s=10.0) is None
    assert stale(10.0, 5.0, 3, 3, 3, session_s=10.0) is None
    assert "old" in (stale(10.0, 4.9, 3, 3, 3, session_s=10.0) or "")
    assert "moved" in (stale(10.0, 9.9, 4, 4, 3, session_s=10.0) or "")
    assert "moved" in (stale(10.0, 9.9, 3, NO_GENERATION, 3, session_s=10.0) or "")
    assert "no heartbeat" in (stale(10.0, 9.9, 2, 3, 3, session_s=10.0) or "")
    assert "no heartbeat" in (stale(10.0, None, NO_GENERATION, 3, 3, session_s=10.0) or "")


def test_a_guard_without_a_group_is_never_fresh() -> None:
    guard = MembershipGuard(FakeClock())
    guard.joined()
    assert guard.generation == NO_GENERATION and guard.stale(NO_GENERATION) is not None


@pytest.mark.kafka
def test_a_stale_member_waits_for_a_heartbeat_and_an_expelled_one_leaves_its_records(
    kafka_settings: KafkaSettings,
) -> None:
    prefix = kafka_settings.topic_prefix
    source, answers, group = f"{prefix}.fence.in", f"{prefix}.fence.out", f"{prefix}.fence.group"

    async def scenario() -> None:
        await create_topics(kafka_settings, {source: 1, answers: 1})
        await produce_json(kafka_settings, source, [{"n": 0}, {"n": 1}])
        clock, stats = FakeClock(), ConsumerStats()
        options = client_options(kafka_settings)
        producer = AIOKafkaProducer(**options, transactional_id=f"fence-{uuid.uuid4()}", **durable_producer())
        await producer.start()
        consumer = AIOKafkaConsumer(
            **options,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            heartbeat_interval_ms=200,
        )
        await consumer.start()
        publisher, outbox, guard = hand_publisher(kafka_settings, producer, consumer, group, answers, clock, stats)
        tp = TopicPartition(source, 0)
        try:
            consumer.subscribe([source])
            await take_records(publisher, consumer, tp, 2)

            # stale (half a session since the join, by the test's clock): aborted, then committed once a
            # heartbeat sent after that is accepted
            clock.advance(guard.session_s * 1000)
            assert guard.stale(guard.generation) is not None
            assert await publisher.publish([Message(answers, b"0", json.dumps(0).encode())], [(tp, 0)])
            assert stats.transactions_self_fenced >= 1
            assert await read_committed(kafka_settings, answers) == ["0"]
            assert (await consumer.committed(tp)) == 1

            # stale with no heartbeat getting through (as when the coordinator is frozen): it waits; then
            # the member leaves the group: nothing of it is published or committed
            await consumer._coordinator._stop_heartbeat_task()
            clock.advance(guard.session_s * 1000)
            publish = asyncio.ensure_future(
                publisher.publish([Message(answers, b"1", json.dumps(1).encode())], [(tp, 1)])
            )
            await asyncio.sleep(1.5)
            fenced = stats.transactions_self_fenced
            assert not publish.done() and fenced >= 2
            consumer.unsubscribe()
            assert await asyncio.wait_for(publish, 30) is False
            assert stats.transactions_self_fenced > fenced
            assert await read_committed(kafka_settings, answers) == ["0"]
        finally:
            await outbox.stop()
            await producer.stop()
            await consumer.stop()
        check = AIOKafkaConsumer(**options, group_id=group, enable_auto_commit=False)
        await check.start()
        try:
            assert (await check.committed(tp)) == 1
        finally:
            await check.stop()

    asyncio.run(scenario())
