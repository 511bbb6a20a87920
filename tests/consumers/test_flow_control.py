"""Under load: priority first, bounded memory, partitions shared across a group."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from pipeline.core.config import ConsumerSettings, KafkaSettings
from tests.consumers.harness import (
    collect,
    cost_model,
    create_topics,
    make_consumer,
    request,
    running,
    send,
    serving,
    topics,
)

pytestmark = pytest.mark.kafka


def test_backpressure_bounds_the_queue_while_everything_is_answered(kafka_settings: KafkaSettings) -> None:
    model = cost_model(a_ms=4.0, c_ms=0.1, partitions=2, hard_cap=16, target_size=8)
    settings = ConsumerSettings(max_queue=40, fetch_max_records=500, commit_interval_ms=50)
    n = 1500

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        await send(kafka_settings, topics(kafka_settings).requests(model.name), [request(i) for i in range(n)])
        async with running(make_consumer(model, kafka_settings, settings)) as consumer:
            results = await collect(
                kafka_settings, topics(kafka_settings).results(model.name), {f"r{i}" for i in range(n)}
            )
        assert len(results.by_id) == n and not results.duplicates
        assert consumer.stats.pauses >= 1
        assert 0 < consumer.stats.max_queue_seen <= settings.max_queue

    asyncio.run(scenario())


def test_priority_topic_is_served_before_the_backlog(kafka_settings: KafkaSettings) -> None:
    model = cost_model(a_ms=40.0, c_ms=0.0, partitions=2, hard_cap=8, target_size=8, tail_mark_ratio=0)
    n_normal, n_priority = 400, 20

    async def scenario() -> None:
        names = topics(kafka_settings)
        async with serving(model, kafka_settings, ConsumerSettings(max_queue=64)):
            await send(kafka_settings, names.requests(model.name), [request(i, "n") for i in range(n_normal)])
            await asyncio.sleep(0.3)
            await send(kafka_settings, names.priority(model.name), [request(i, "p") for i in range(n_priority)])
            ids = {f"n{i}" for i in range(n_normal)} | {f"p{i}" for i in range(n_priority)}
            results = await collect(kafka_settings, names.results(model.name), ids, timeout_s=90)
        assert set(results.by_id) == ids
        rank = {rid: i for i, rid in enumerate(results.order)}
        # every priority request overtakes the normal backlog fetched after it arrived
        normal_after_priority_sent = [
            rid
            for rid in results.order
            if rid.startswith("n") and rank[rid] > max(rank[f"p{i}"] for i in range(n_priority))
        ]
        assert len(normal_after_priority_sent) > n_normal / 2
        p_e2e = [
            results.by_id[f"p{i}"][0]["done_ms"] - results.by_id[f"p{i}"][0]["enqueue_ms"] for i in range(n_priority)
        ]
        n_e2e = [
            results.by_id[f"n{i}"][0]["done_ms"] - results.by_id[f"n{i}"][0]["enqueue_ms"] for i in range(n_normal)
        ]
        assert statistics.median(p_e2e) * 3 < statistics.median(n_e2e)

    asyncio.run(scenario())


def test_a_group_splits_partitions_and_loses_nothing_when_members_come_and_go(kafka_settings: KafkaSettings) -> None:
    model = cost_model(a_ms=2.0, c_ms=0.05, partitions=6)
    settings = ConsumerSettings(commit_interval_ms=50)
    n = 3000

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        names = topics(kafka_settings)
        first, second = (
            make_consumer(model, kafka_settings, settings, "c1"),
            make_consumer(model, kafka_settings, settings, "c2"),
        )
        async with running(first), running(second):
            producing = asyncio.create_task(_trickle(kafka_settings, names.requests(model.name), n, per_s=250))
            await _until(lambda: len(first.membership.owned()) > 0 and len(second.membership.owned()) > 0)
            split = (len(first.membership.owned()), len(second.membership.owned()))
            await asyncio.sleep(1.0)
            async with running(make_consumer(model, kafka_settings, settings, "c3")) as third:
                await _until(lambda: len(third.membership.owned()) > 0)
                await _until(lambda: third.stats.answered["ok"] > 0 or producing.done())
            await producing
            results = await collect(
                kafka_settings, names.results(model.name), {f"r{i}" for i in range(n)}, timeout_s=60
            )
        assert split[0] + split[1] == 12 and split[0] >= 2 and split[1] >= 2  # requests + priority topics
        assert len(results.by_id) == n, f"missing: {sorted({f'r{i}' for i in range(n)} - set(results.by_id))[:10]}"
        assert third.stats.answered["ok"] > 0
        served_by = {answers[0]["consumer_id"] for answers in results.by_id.values()}
        assert served_by == {"c1", "c2", "c3"}

    asyncio.run(scenario())


async def _trickle(kafka: KafkaSettings, topic: str, n: int, per_s: float) -> None:
    chunk = 50
    for start in range(0, n, chunk):
        await send(kafka, topic, [request(i) for i in range(start, min(n, start + chunk))])
        await asyncio.sleep(chunk / per_s)


async def _until(condition, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.05)
