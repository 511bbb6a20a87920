"""Delivery guarantees: a crash loses nothing, transactions answer exactly once, tails forwarded once."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from pipeline.core.config import ConsumerSettings, KafkaSettings
from pipeline.tools.harness.config_file import kafka_table, toml_text
from pipeline.tools.harness.processes import Proc, consume_argv
from tests.consumers.harness import (
    MODEL,
    collect,
    committed_offsets,
    cost_model,
    create_topics,
    make_consumer,
    request,
    running,
    send,
    serving,
    topics,
)
from tests.support.kafka import produce_json


def _config_file(path: Path, kafka: KafkaSettings) -> Path:
    path.write_text(toml_text({
        f"models.{MODEL}": {"runner": "cost-model", "cost_a_ms": 8.0, "cost_c_ms": 0.2, "partitions": 3, "hard_cap": 16, "target_size": 8},
        "kafka": kafka_table(kafka),
        "consumer": {"commit_interval_ms": 20},
    }))  # fmt: skip
    return path


def test_a_killed_consumer_never_committed_past_an_unanswered_request(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    n = 3000
    config = _config_file(tmp_path / "batchtide.toml", kafka_settings)

    async def scenario() -> None:
        model = cost_model(partitions=3)
        await create_topics(kafka_settings, model)
        names = topics(kafka_settings)
        values = [request(i) for i in range(n)]
        placed = await produce_json(kafka_settings, names.requests(MODEL), values, key=lambda v: v["id"])
        where = {v["id"]: (m.partition, m.offset) for v, m in zip(values, placed, strict=True)}
        child = Proc("consumer", consume_argv(MODEL, config, "doomed"), tmp_path)
        child.start()
        try:
            first = await collect(
                kafka_settings, names.results(MODEL), {f"r{i}" for i in range(n // 4)}, timeout_s=90, grace_s=0
            )
        finally:
            child.kill()
        group = f"{kafka_settings.topic_prefix}.consumers.{MODEL}"
        committed = await committed_offsets(kafka_settings, names.requests(MODEL), 3, group)
        answered_before = await collect(kafka_settings, names.results(MODEL), set(), grace_s=1.0)
        assert sum(committed.values()) > 0, child.log_text()[-3000:]
        for rid, (partition, offset) in where.items():
            if offset < committed[partition]:
                assert rid in answered_before.by_id, (
                    f"{rid} committed (offset {offset} < {committed[partition]}) but never answered"
                )
        assert len(answered_before.by_id) < n, "the consumer finished before it was killed; the test proves nothing"
        async with running(make_consumer(model, kafka_settings, name="survivor")):
            after = await collect(kafka_settings, names.results(MODEL), {f"r{i}" for i in range(n)}, timeout_s=90)
        assert len(after.by_id) == n
        assert len(first.by_id) >= n // 4

    asyncio.run(scenario())


def test_transactions_answer_every_request_exactly_once(kafka_settings: KafkaSettings) -> None:
    kafka = dataclasses.replace(kafka_settings, transactional=True)
    model = cost_model(partitions=2)
    n = 400

    async def scenario() -> None:
        names = topics(kafka)
        async with serving(model, kafka, ConsumerSettings(commit_interval_ms=50)) as consumer:
            await send(kafka, names.requests(MODEL), [request(i) for i in range(n)])
            results = await collect(kafka, names.results(MODEL), {f"r{i}" for i in range(n)}, grace_s=1.0)
        assert len(results.by_id) == n and not results.duplicates
        assert consumer.stats.commits > 0
        group = f"{kafka.topic_prefix}.consumers.{MODEL}"
        committed = await committed_offsets(kafka, names.requests(MODEL), 2, group)
        assert sum(committed.values()) == n

    asyncio.run(scenario())


def test_forwarded_tails_are_answered_exactly_once_on_a_skewed_load(kafka_settings: KafkaSettings) -> None:
    # all traffic on partition 0: one consumer drowns, the other idles unless tails are forwarded
    model = cost_model(
        a_ms=10.0, c_ms=0.5, partitions=2, hard_cap=8, target_size=8, tail_min_samples=8, tail_mark_floor_ms=1.0
    )
    settings = ConsumerSettings(commit_interval_ms=50, tail_forwarding=True, max_queue=2000)
    n = 1200

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        names = topics(kafka_settings)
        first = make_consumer(model, kafka_settings, settings, "c1")
        second = make_consumer(model, kafka_settings, settings, "c2")
        async with running(first), running(second):
            while not (first.membership.owned() and second.membership.owned()):
                await asyncio.sleep(0.05)
            for start in range(0, n, 100):
                await send(
                    kafka_settings, names.requests(MODEL), [request(i) for i in range(start, start + 100)], partition=0
                )
                await asyncio.sleep(0.05)
            results = await collect(
                kafka_settings, names.results(MODEL), {f"r{i}" for i in range(n)}, timeout_s=90, grace_s=1.0
            )
        assert len(results.by_id) == n
        assert not results.duplicates
        forwarded = first.stats.forwarded + second.stats.forwarded
        assert forwarded > 0
        served = {c: sum(1 for a in results.by_id.values() if a[0]["consumer_id"] == c) for c in ("c1", "c2")}
        assert min(served.values()) > 0, served

    asyncio.run(scenario())


def test_a_straggler_hands_work_to_its_fast_peer_exactly_once_through_a_rebalance(
    kafka_settings: KafkaSettings,
) -> None:
    """Transactions: each forward and its original's offset commit together. A third consumer joins
    while the slow one forwards (every partition moves); read_committed, each answer appears once."""
    kafka = dataclasses.replace(kafka_settings, transactional=True)
    fast = cost_model(a_ms=5.0, c_ms=0.5, partitions=4)
    slow = cost_model(a_ms=60.0, c_ms=6.0, partitions=4)
    settings = ConsumerSettings(commit_interval_ms=50, fleet_beacon_ms=100)
    n = 1600

    async def scenario() -> None:
        await create_topics(kafka, fast)
        names = topics(kafka)
        snail = make_consumer(slow, kafka, settings, "slow")
        hare = make_consumer(fast, kafka, settings, "fast")
        async with running(snail), running(hare):
            while not (snail.membership.owned() and hare.membership.owned()):
                await asyncio.sleep(0.05)
            for start in range(0, n // 2, 50):
                await send(kafka, names.requests(MODEL), [request(i) for i in range(start, start + 50)])
                await asyncio.sleep(0.05)
            forwarded_before = snail.stats.forwarded
            async with running(make_consumer(fast, kafka, settings, "late")):
                for start in range(n // 2, n, 50):
                    await send(kafka, names.requests(MODEL), [request(i) for i in range(start, start + 50)])
                    await asyncio.sleep(0.05)
                results = await collect(
                    kafka, names.results(MODEL), {f"r{i}" for i in range(n)}, timeout_s=120, grace_s=2.0
                )
        assert len(results.by_id) == n
        assert not results.duplicates
        assert forwarded_before > 0, "the slow consumer handed work on before the rebalance"
        assert snail.stats.forwarded > forwarded_before, "and after it"
        served = {
            c: sum(1 for a in results.by_id.values() if a[0]["consumer_id"] == c) for c in ("slow", "fast", "late")
        }
        assert served["fast"] + served["late"] > served["slow"], served

    asyncio.run(scenario())
