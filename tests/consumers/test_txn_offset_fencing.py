"""The group coordinator refuses a transaction's offsets from a member that is not current (KIP-447).

Against the real broker: a consumer joins a group, and a transactional producer made to send
TxnOffsetCommit v3 (`fence_txn_offsets`) commits an answer and an offset in one transaction as
that member with a stale generation, as a member the group does not know, and as the member it
is. The first two are refused and land nothing; the last lands. aiokafka's own v0 carries no
member and would commit all three. Then the whole path: a consumer expelled while its own guard
still counts it fresh has its publisher's transaction refused, aborted and given up.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.client import ConnectionGroup, CoordinationType

from consumers.stats import ConsumerStats
from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options, create_topics, durable_producer
from pipeline.core.kafka.offset_fetch import NO_OFFSET, UNSTABLE_OFFSET_COMMIT, fetch_committed
from pipeline.core.kafka.outbox import Message
from pipeline.core.kafka.txn_offset_commit import (
    ILLEGAL_GENERATION,
    UNKNOWN_MEMBER_ID,
    VERSION,
    GroupMember,
    TxnOffsetsRefused,
    fence_txn_offsets,
)
from tests.consumers.harness import hand_publisher, read_committed, take_records
from tests.support.clock import FakeClock
from tests.support.kafka import produce_json

pytestmark = pytest.mark.kafka


def test_offsets_of_a_stale_or_unknown_member_are_refused_and_the_current_members_land(
    kafka_settings: KafkaSettings,
) -> None:
    prefix = kafka_settings.topic_prefix
    source, answers, group = f"{prefix}.zombie.in", f"{prefix}.zombie.out", f"{prefix}.zombie.group"
    tp = TopicPartition(source, 0)

    async def scenario() -> None:
        await create_topics(kafka_settings, {source: 1, answers: 1})
        await produce_json(kafka_settings, source, [{"n": n} for n in range(5)])
        options = client_options(kafka_settings)
        consumer = AIOKafkaConsumer(**options, group_id=group, enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        producer = AIOKafkaProducer(**options, transactional_id=f"zombie-{uuid.uuid4()}", **durable_producer())
        await producer.start()
        try:
            consumer.subscribe([source])
            for _ in range(100):
                await consumer.getmany(timeout_ms=100)
                if consumer.assignment():
                    break
            coordinator = consumer._coordinator
            current = GroupMember(coordinator.generation, coordinator.member_id)
            assert current.generation_id > 0 and current.member_id
            await consumer.commit({tp: (1, "")})
            node = coordinator.coordinator_id
            conn = await consumer._client._get_conn(node, group=ConnectionGroup.COORDINATION)
            low, high = conn._versions[28]
            assert low <= VERSION <= high, "the broker speaks TxnOffsetCommit v3"

            acting_as = [current]
            fence_txn_offsets(producer, lambda: acting_as[0])

            async def commit(offset: int, answer: str) -> None:
                async with producer.transaction():
                    await producer.send_and_wait(answers, answer.encode())
                    await producer.send_offsets_to_transaction({tp: (offset, "")}, group)

            stale = GroupMember(current.generation_id - 1, current.member_id)
            unknown = GroupMember(current.generation_id, f"zombie-{uuid.uuid4()}")
            for member, code in ((stale, ILLEGAL_GENERATION), (unknown, UNKNOWN_MEMBER_ID)):
                acting_as[0] = member
                with pytest.raises(TxnOffsetsRefused) as refused:
                    await commit(3, f"zombie {code}")
                assert refused.value.error_code == code

            assert await read_committed(kafka_settings, answers) == [], "the refused transactions were aborted"
            _, committed = await fetch_committed(consumer._client, node, group, [tp])
            assert (committed[tp].offset, committed[tp].error) == (1, 0), "no offset landed, none left pending"

            acting_as[0] = current
            await commit(4, "owner")
            for _ in range(100):
                _, committed = await fetch_committed(consumer._client, node, group, [tp])
                if committed[tp].error != UNSTABLE_OFFSET_COMMIT:
                    break
                await asyncio.sleep(0.1)
            assert (committed[tp].offset, committed[tp].error) == (4, 0)
            assert await read_committed(kafka_settings, answers) == ["owner"]

            acting_as[0] = GroupMember(-1, "")
            with pytest.raises(TxnOffsetsRefused):
                await commit(5, "not a member")  # v3 without a member would be accepted like v0
            _, committed = await fetch_committed(consumer._client, node, group, [tp])
            assert committed[tp].offset == 4 and committed[tp].offset != NO_OFFSET
            assert await read_committed(kafka_settings, answers) == ["owner"]
            assert producer._sender._coordinators.get(CoordinationType.GROUP) == node
        finally:
            await producer.stop()
            await consumer.stop()

    asyncio.run(scenario())


def test_an_expelled_consumer_that_believes_it_is_fresh_has_its_transaction_refused_and_aborted(
    kafka_settings: KafkaSettings,
) -> None:
    """The zombie of a frozen coordinator: a member whose heartbeats stopped is expelled and the group
    moves on without it, while its own guard (the test's clock stands still) still counts it fresh.
    Its publisher's transaction goes as TxnOffsetCommit v3 (as `consumers.clients` wires it): the
    coordinator refuses the offsets, the transaction is aborted, counted, and the batch given up."""
    prefix = kafka_settings.topic_prefix
    source, answers, group = f"{prefix}.expelled.in", f"{prefix}.expelled.out", f"{prefix}.expelled.group"
    tp = TopicPartition(source, 0)

    async def scenario() -> None:
        await create_topics(kafka_settings, {source: 1, answers: 1})
        await produce_json(kafka_settings, source, [{"n": 0}, {"n": 1}])
        clock, stats = FakeClock(), ConsumerStats()
        options = client_options(kafka_settings)
        producer = AIOKafkaProducer(**options, transactional_id=f"expelled-{uuid.uuid4()}", **durable_producer())
        await producer.start()
        zombie = AIOKafkaConsumer(
            **options,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            session_timeout_ms=6000,
            heartbeat_interval_ms=200,
        )
        successor = AIOKafkaConsumer(**options, group_id=group, enable_auto_commit=False, auto_offset_reset="earliest")
        await zombie.start()
        publisher, outbox, guard = hand_publisher(kafka_settings, producer, zombie, group, answers, clock, stats)
        fence_txn_offsets(producer, guard.member)
        try:
            zombie.subscribe([source])
            await take_records(publisher, zombie, tp, 2)
            generation = guard.generation
            assert await publisher.publish([Message(answers, b"0", json.dumps(0).encode())], [(tp, 0)])
            assert await read_committed(kafka_settings, answers) == ["0"]

            # its heartbeats stop (a frozen coordinator); a successor joins and, once the session has
            # expired, the group forms the next generation without it
            await zombie._coordinator._stop_heartbeat_task()
            await successor.start()
            successor.subscribe([source])
            for _ in range(120):
                await successor.getmany(timeout_ms=250)
                if successor.assignment():
                    break
            assert successor.assignment() == {tp}
            assert guard.generation == generation and guard.stale(generation) is None, "it believes it is fresh"

            published = await asyncio.wait_for(
                publisher.publish([Message(answers, b"1", json.dumps(1).encode())], [(tp, 1)]), 30
            )
            assert published is False and stats.txn_offsets_refused == 1
            assert await read_committed(kafka_settings, answers) == ["0"], "the zombie's answer was aborted"
            assert await successor.committed(tp) == 1, "its offset did not land"
        finally:
            await outbox.stop()
            await producer.stop()
            await successor.stop()
            await zombie.stop()

    asyncio.run(scenario())
