"""A new owner of a partition starts at its stable commit point and skips what was answered past it.

The codec and the tracker run on plain numbers; the OffsetFetch v7 request and the takeover run
against the real broker: a previous owner answers records out of order and commits (through the
real `Publisher`, in a transaction or not), then a real consumer takes the partition over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from consumers.clock import SystemClock
from consumers.stable_start import StableStart
from consumers.stats import ConsumerStats
from pipeline.core.config import ConsumerSettings, KafkaSettings
from pipeline.core.kafka.client import client_options, create_topics, durable_producer
from pipeline.core.kafka.offset_fetch import NO_OFFSET, UNSTABLE_OFFSET_COMMIT, fetch_committed
from pipeline.core.kafka.offsets import METADATA_TAG, CommitPoint, OffsetTracker
from pipeline.core.kafka.outbox import Message
from tests.consumers.harness import (
    collect,
    cost_model,
    hand_publisher,
    make_consumer,
    request,
    running,
    send,
    take_records,
    topics,
)
from tests.consumers.harness import create_topics as create_model_topics
from tests.support.clock import FakeClock
from tests.support.kafka import produce_json


def test_a_commit_point_round_trips_as_ranges_relative_to_its_offset() -> None:
    point = CommitPoint(100, frozenset({103, 109, 110, 111, 112}))
    metadata, left_out = point.encode()
    assert (metadata, left_out) == ("bt1 3,9-4", 0)
    assert CommitPoint.decode(100, metadata) == point
    assert CommitPoint(7).encode() == (METADATA_TAG, 0)
    assert CommitPoint(100, frozenset({98, 99, 100})).encode() == ("bt1 0", 0)  # nothing below the offset


def test_metadata_not_ours_or_damaged_lists_nothing() -> None:
    for metadata in ("", None, "some other client", "bt1 x,3", "bt2 1,2", "bt1 ", "bt1 0-0", "bt1 1-999999999"):
        assert CommitPoint.decode(5, metadata) == CommitPoint(5)


def test_metadata_past_the_cap_leaves_the_highest_offsets_out_and_counts_them() -> None:
    answered = frozenset(range(1000, 10_000, 2))  # 4500 single offsets: far over any cap
    metadata, left_out = CommitPoint(0, answered).encode(max_chars=200)
    assert len(metadata) <= 200 and left_out > 0
    kept = CommitPoint.decode(0, metadata).answered
    assert len(kept) + left_out == len(answered)
    assert kept and max(kept) < min(answered - kept)


def test_an_inheriting_tracker_skips_the_answered_and_carries_the_unread_into_its_commits() -> None:
    tracker: OffsetTracker[str] = OffsetTracker()
    tracker.inherit("p", CommitPoint(10, frozenset({12, 13, 20})))
    assert tracker.to_commit() == {}  # the inherited point is already committed
    assert [tracker.received("p", o) for o in (10, 11, 12, 13, 14)] == [True, True, False, False, True]
    tracker.answered("p", 11)
    # 10 is still the first unanswered, but 11 is answered past it now: the metadata grows
    assert tracker.to_commit() == {"p": 10}
    assert tracker.point("p", 10).encode() == ("bt1 1-3,10", 0)
    tracker.answered("p", 10)
    assert tracker.to_commit() == {"p": 14}
    # 20 was never read here: the next owner must still skip it
    assert tracker.point("p", 14).encode() == ("bt1 6", 0)


def test_a_commit_runs_again_when_more_is_answered_past_an_offset_that_does_not_move() -> None:
    """The first record of a partition may stay unanswered for long (a frozen broker, a slow
    batch) while hundreds past it are answered: each commit must list them for the next owner."""
    tracker: OffsetTracker[str] = OffsetTracker()
    for offset in range(6):
        tracker.received("p", offset)
    tracker.answered("p", 2)
    assert tracker.to_commit() == {"p": 0}
    tracker.committed({"p": tracker.point("p", 0)})
    assert tracker.to_commit() == {}
    tracker.answered("p", 4)
    tracker.answered("p", 3)
    assert tracker.to_commit() == {"p": 0}
    assert tracker.point("p", 0).encode() == ("bt1 2-3", 0)
    tracker.committed({"p": tracker.point("p", 0)})
    assert tracker.to_commit() == {}


@pytest.mark.kafka
def test_require_stable_waits_for_an_open_transaction_carrying_offsets(kafka_settings: KafkaSettings) -> None:
    prefix = kafka_settings.topic_prefix
    source, group = f"{prefix}.stable.in", f"{prefix}.stable.group"
    tp = TopicPartition(source, 0)

    async def scenario() -> None:
        await create_topics(kafka_settings, {source: 1})
        await produce_json(kafka_settings, source, [{"n": n} for n in range(5)])
        options = client_options(kafka_settings)
        producer = AIOKafkaProducer(**options, transactional_id=f"stable-{uuid.uuid4()}", **durable_producer())
        await producer.start()
        consumer = AIOKafkaConsumer(**options, group_id=group, enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign([tp])
            await consumer.commit({tp: (1, "bt1 1")})
            coordinator = consumer._coordinator
            await coordinator.ensure_coordinator_known()
            node, client = coordinator.coordinator_id, consumer._client

            error, stable = await fetch_committed(client, node, group, [tp])
            assert error == 0 and (stable[tp].offset, stable[tp].metadata, stable[tp].error) == (1, "bt1 1", 0)
            async with producer.transaction():
                await producer.send_offsets_to_transaction({tp: (3, "bt1 1-2")}, group)
                _, pending = await fetch_committed(client, node, group, [tp])
                assert pending[tp].error == UNSTABLE_OFFSET_COMMIT
                _, unstable = await fetch_committed(client, node, group, [tp], require_stable=False)
                assert (unstable[tp].offset, unstable[tp].error) == (1, 0)  # the last stable commit
            # the end markers reach the group coordinator a moment after the transaction ends
            for _ in range(100):
                _, after = await fetch_committed(client, node, group, [tp])
                if after[tp].error != UNSTABLE_OFFSET_COMMIT:
                    break
                await asyncio.sleep(0.1)
            assert (after[tp].offset, after[tp].metadata, after[tp].error) == (3, "bt1 1-2", 0)
            _, other = await fetch_committed(client, node, f"{group}.none", [tp])
            assert other[tp].offset == NO_OFFSET
        finally:
            await producer.stop()
            await consumer.stop()

    asyncio.run(scenario())


@pytest.mark.kafka
def test_a_new_owner_waits_for_an_open_transaction_and_starts_at_its_commit_point(
    kafka_settings: KafkaSettings,
) -> None:
    """The last owner's transaction carries offset 2 with 3 and 4 answered past it and is still
    open when the partition is assigned: the partition stays paused until it commits, then starts
    at 2 and skips 3 and 4 (aiokafka alone would have started at 0: nothing stable committed yet)."""
    prefix = kafka_settings.topic_prefix
    source, group = f"{prefix}.wait.in", f"{prefix}.wait.group"
    tp = TopicPartition(source, 0)

    async def scenario() -> None:
        await create_topics(kafka_settings, {source: 1})
        await produce_json(kafka_settings, source, [{"n": n} for n in range(6)])
        options = client_options(kafka_settings)
        producer = AIOKafkaProducer(**options, transactional_id=f"wait-{uuid.uuid4()}", **durable_producer())
        await producer.start()
        consumer = AIOKafkaConsumer(**options, group_id=group, enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        stats, tracker = ConsumerStats(), OffsetTracker[TopicPartition]()
        stable = StableStart(consumer, tracker, group, stats, SystemClock())

        class Listener(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked: object) -> None:
                return None

            async def on_partitions_assigned(self, assigned: object) -> None:
                stable.assigned(set(consumer.assignment()))

        try:
            await producer.begin_transaction()
            await producer.send_offsets_to_transaction({tp: (2, "bt1 1-2")}, group)
            consumer.subscribe([source], listener=Listener())
            for _ in range(100):
                assert await consumer.getmany(timeout_ms=100) == {}
                if consumer.assignment():
                    break
            await asyncio.sleep(1.0)
            assert stable.holding == {tp}, "held while the transaction is open"
            await producer.commit_transaction()
            for _ in range(100):
                if not stable.holding:
                    break
                await asyncio.sleep(0.1)
            assert not stable.holding
            consumer.resume(tp)  # the fetcher does this in the consumer
            records = []
            for _ in range(50):
                records += [r for b in (await consumer.getmany(timeout_ms=200)).values() for r in b]
                if len(records) >= 4:
                    break
            assert [r.offset for r in records] == [2, 3, 4, 5]
            assert [tracker.received(tp, r.offset) for r in records] == [True, False, False, True]
            assert (stats.unstable_offsets_waited, stats.unstable_offsets_given_up, stats.answered_inherited) == (
                1,
                0,
                2,
            )
        finally:
            await stable.stop()
            await producer.stop()
            await consumer.stop()

    asyncio.run(scenario())


@pytest.mark.kafka
@pytest.mark.parametrize("transactional", [True, False])
def test_a_new_owner_skips_what_the_last_owner_answered_past_its_commit(
    kafka_settings: KafkaSettings, transactional: bool
) -> None:
    """The last owner answered 8..17 of 0..19 (out of order) and committed 0 with them in its
    metadata, then left; the next owner answers 0..7, 18, 19 only: every request once."""
    kafka = dataclasses.replace(kafka_settings, transactional=transactional)
    model = cost_model(partitions=1)
    names = topics(kafka)
    source, results, group = names.requests(model.name), names.results(model.name), names.group(model.name)
    tp = TopicPartition(source, 0)
    ids = {f"r{i}" for i in range(20)}

    async def last_owner() -> None:
        clock, stats = FakeClock(), ConsumerStats()
        options = client_options(kafka)
        txn = {"transactional_id": f"stable-{uuid.uuid4()}"} if transactional else {}
        producer = AIOKafkaProducer(**options, **txn, **durable_producer())
        await producer.start()
        consumer = AIOKafkaConsumer(
            **options,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
        )
        await consumer.start()
        publisher, outbox, _ = hand_publisher(
            kafka, producer, consumer, group, results, clock, stats, transactional=transactional
        )
        try:
            consumer.subscribe([source])
            records = await take_records(publisher, consumer, tp, 20)
            answered = [r for r in records if 8 <= r.offset <= 17]
            messages = [
                Message(results, f"r{r.offset}".encode(), json.dumps({"id": f"r{r.offset}"}).encode()) for r in answered
            ]
            assert await publisher.publish(messages, [(tp, r.offset) for r in answered])
            await publisher.commit()
            assert stats.commits >= 1 and publisher.tracker.to_commit() == {}
        finally:
            await outbox.stop()
            await producer.stop()
            await consumer.stop()

    async def scenario() -> None:
        await create_model_topics(kafka, model)
        await send(kafka, source, [request(i) for i in range(20)], partition=0)
        await last_owner()
        consumer = make_consumer(model, kafka, ConsumerSettings(commit_interval_ms=50))
        async with running(consumer):
            answers = await collect(kafka, results, ids, timeout_s=60, grace_s=2.0)
        assert ids <= answers.by_id.keys()
        assert answers.duplicates == {}
        assert consumer.stats.answered_inherited == 10
        assert consumer.stats.stale_offset_records_skipped == 10
        assert consumer.stats.answered["ok"] == 10

    asyncio.run(scenario())
