"""Delivery guarantees: a crash loses nothing, transactions answer exactly once, tails forwarded once."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from consumers.runners import make_runner
from consumers.worker import Consumer
from pipeline.core.config import BatchProfile, ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.core.engine import BatchingEngine
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
from tests.support.models import build_tiny_gpt2

pytestmark = pytest.mark.kafka


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


def _generating(model_path: Path, kafka: KafkaSettings, settings: ConsumerSettings, name: str) -> Consumer:
    """An iteration-level generating consumer of a real (tiny) model, run in this process."""
    model = ModelConfig(
        name=MODEL, model_path=str(model_path), task="generate", batching="iteration", isolation="thread",
        torch_threads=1, max_new_tokens=24, partitions=4,
        profile=BatchProfile(hard_cap=1, target_size=1, max_inflight_batches=12, max_wait_ms=0.0, adaptive_cap=False),
    )  # fmt: skip
    return Consumer(
        model, kafka, settings, runner=make_runner(model), engine=BatchingEngine(model.profile), consumer_id=name
    )


@pytest.mark.model
def test_generating_consumers_answer_every_request_once_when_one_joins_mid_load(
    tiny_gpt2_dir: Path, tmp_path: Path, kafka_settings: KafkaSettings
) -> None:
    """Two iteration-level generating consumers of real models, one with a heavier (slower) model and the
    decode balance on, then a third joining while requests run in their decode loops: every partition
    moves, the running sets are revoked mid-answer, forwards and their originals' offsets commit
    together; read_committed, every request is answered exactly once."""
    kafka = dataclasses.replace(kafka_settings, transactional=True)
    heavy = build_tiny_gpt2(tmp_path / "heavy", layers=6, hidden=128)
    settings = ConsumerSettings(commit_interval_ms=50, fleet_beacon_ms=100)
    n = 240

    async def scenario() -> None:
        first = _generating(heavy, kafka, settings, "slow")
        second = _generating(tiny_gpt2_dir, kafka, settings, "fast")
        await create_topics(kafka, first.model)
        names = topics(kafka)
        asks = [request(i, params={"max_new_tokens": 8 + i % 16}) for i in range(n)]
        async with running(first), running(second):
            while not (first.membership.owned() and second.membership.owned()):
                await asyncio.sleep(0.05)
            for start in range(0, n // 3, 10):
                await send(kafka, names.requests(MODEL), asks[start : start + 10])
                await asyncio.sleep(0.1)
            late = _generating(tiny_gpt2_dir, kafka, settings, "late")
            joining = asyncio.create_task(late.start())  # it joins while requests run in both decode loops
            for start in range(n // 3, 2 * n // 3, 10):
                await send(kafka, names.requests(MODEL), asks[start : start + 10])
                await asyncio.sleep(0.1)
            await joining
            stop = asyncio.Event()
            serving = asyncio.create_task(late.run(stop))
            while not late.membership.owned():
                await asyncio.sleep(0.05)
            for start in range(2 * n // 3, n, 10):
                await send(kafka, names.requests(MODEL), asks[start : start + 10])
                await asyncio.sleep(0.1)
            try:
                results = await collect(
                    kafka, names.results(MODEL), {f"r{i}" for i in range(n)}, timeout_s=180, grace_s=2.0
                )
            finally:
                stop.set()
                await asyncio.wait_for(serving, 60)
                late.runner.close()
        for consumer in (first, second):
            consumer.runner.close()
        assert len(results.by_id) == n, f"{n - len(results.by_id)} unanswered"
        assert not results.duplicates, sorted(results.duplicates)[:5]
        assert all(answers[0]["outcome"] == "ok" for answers in results.by_id.values())
        assert late.stats.batches > 0, "the late consumer joined the group and served"
        assert first.stats.forwarded > 0, "the slow decode loop handed new requests to its faster peers"
        served = Counter(answers[0]["consumer_id"] for answers in results.by_id.values())
        assert served["fast"] + served["late"] > served["slow"], served

    asyncio.run(scenario())
