"""N requests in, N answers out: results, events, expiry, offsets."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from consumers.answers import DECISION_FIELDS, Answers, BatchTiming
from consumers.runners import serving_runner
from consumers.runners.device_process import ProcessRunner
from consumers.worker import Consumer
from pipeline.core.config import ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.core.engine import BatchingEngine
from pipeline.core.engine.decisions import Batch, DispatchRecord
from pipeline.core.kafka.client import Topics
from pipeline.core.kafka.topic_limits import TopicLimits
from tests.consumers.harness import (
    MODEL,
    collect,
    committed_offsets,
    cost_model,
    create_topics,
    request,
    running,
    send,
    serving,
    topics,
)
from tests.support.kafka import consume_n, json_values


@pytest.mark.model
@pytest.mark.kafka
def test_every_request_answered_once_by_a_real_model(kafka_settings: KafkaSettings, tiny_bert_dir: Path) -> None:
    """The served path: the model computes in a device process (isolation auto)."""
    model = ModelConfig(
        name=MODEL, runner="transformers", model_path=str(tiny_bert_dir), task="embed", device="cpu", partitions=3
    )
    n = 150

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        consumer = Consumer(
            model,
            kafka_settings,
            ConsumerSettings(commit_interval_ms=50),
            runner=serving_runner(model),
            engine=BatchingEngine(model.profile),
            consumer_id="bert-1",
        )
        assert isinstance(consumer.runner, ProcessRunner)
        ids = {f"r{i}" for i in range(n)}
        try:
            async with running(consumer):
                await send(kafka_settings, topics(kafka_settings).requests(MODEL), [request(i) for i in range(n)])
                results = await collect(kafka_settings, topics(kafka_settings).results(MODEL), ids)
                latency = await collect(
                    kafka_settings, topics(kafka_settings).latency_events, ids, key_field="request_id"
                )
                batches = await collect(
                    kafka_settings, topics(kafka_settings).batch_events, set(), grace_s=1.0, key_field="batch_id"
                )
        finally:
            consumer.runner.close()
        assert set(results.by_id) == ids
        assert not results.duplicates
        # a real model is warmed at doubling batch sizes before joining the group, up to the
        # engine's ceiling (at most 64) as far as the warm-up's time budget reaches on this host
        sizes = consumer.stats.warm_up_sizes
        assert sizes == [2**i for i in range(len(sizes))] and 4 <= sizes[-1] <= 64
        for answers in results.by_id.values():
            (result,) = answers
            assert result["outcome"] == "ok"
            assert len(result["embedding"]) > 0
            assert result["consumer_id"] == "bert-1"
        assert set(latency.by_id) == ids and not latency.duplicates
        for (event,) in latency.by_id.values():
            assert event["enqueue_ms"] <= event["fetch_ms"] <= event["dispatch_ms"] + 1
            assert event["dispatch_ms"] <= event["compute_start_ms"] <= event["compute_end_ms"] <= event["produce_ms"]
            assert event["wait_ms"] == event["dispatch_ms"] - event["enqueue_ms"]
            assert event["e2e_ms"] == event["produce_ms"] - event["enqueue_ms"]
            assert event["tokens_in"] > 0 and event["batch_size"] >= 1
            assert event["device_mem_kind"] == "process_rss" and event["device_mem_bytes"] > 0
        sizes = [b[0]["size"] for b in batches.by_id.values()]
        assert sum(sizes) == n
        assert all(b[0]["compute_ms"] > 0 and b[0]["effective_cap"] >= 1 for b in batches.by_id.values())
        group = f"{kafka_settings.topic_prefix}.consumers.{MODEL}"
        committed = await committed_offsets(kafka_settings, topics(kafka_settings).requests(MODEL), 3, group)
        assert sum(committed.values()) == n

    asyncio.run(scenario())


@pytest.mark.kafka
def test_requests_past_their_deadline_are_answered_expired(kafka_settings: KafkaSettings) -> None:
    model = cost_model(a_ms=200.0, c_ms=0.0, partitions=1, hard_cap=4, target_size=4)

    async def scenario() -> None:
        now = int(time.time() * 1000)
        late = [request(i, "late", deadline_ms=now - 1000) for i in range(5)]
        short = [request(i, "short", timeout_ms=50) for i in range(12)]
        warm = dict(request(0, "warm-refused"), warmup=True, priority=99)  # refused, and warm-up all the same
        ids = {r["id"] for r in late + short}
        async with serving(model, kafka_settings) as consumer:
            await send(kafka_settings, topics(kafka_settings).requests(MODEL), [warm, *late, *short])
            results = await collect(kafka_settings, topics(kafka_settings).results(MODEL), ids | {warm["id"]})
            events = await collect(
                kafka_settings, topics(kafka_settings).latency_events, ids | {warm["id"]}, key_field="request_id"
            )
        outcomes = {k: v[0]["outcome"] for k, v in results.by_id.items()}
        assert outcomes.pop(warm["id"]) == "rejected"
        (refused,) = events.by_id[warm["id"]]
        assert (refused["outcome"], refused["reason"], refused["warmup"]) == ("rejected", "schema", True)
        for rid, outcome in outcomes.items():
            (event,) = events.by_id[rid]
            assert (event["outcome"], event["reason"]) == (outcome, "deadline" if outcome == "expired" else "")
        assert set(outcomes) == ids and not results.duplicates
        assert all(outcomes[r["id"]] == "expired" for r in late)
        # 12 requests, batches of 4 taking 200 ms each, 50 ms timeout: most expire while waiting
        assert sum(outcomes[r["id"]] == "expired" for r in short) >= 4
        assert consumer.stats.answered["expired"] == sum(o == "expired" for o in outcomes.values())
        assert consumer.stats.warm_up_sizes == [1]  # a simulated device needs no warming

    asyncio.run(scenario())


@pytest.mark.kafka
def test_a_request_id_seen_again_while_its_batch_runs_is_a_duplicate(kafka_settings: KafkaSettings) -> None:
    """The id must stay known between dispatch and the published answer, or a resend is computed twice."""
    model = cost_model(a_ms=600.0, c_ms=0.0, partitions=1)

    async def scenario() -> None:
        original = request(0, "dup")
        async with serving(model, kafka_settings) as consumer:
            await send(kafka_settings, topics(kafka_settings).requests(MODEL), [original])
            for _ in range(200):  # until its batch is on the device (600 ms of compute)
                if consumer.stats.batches:
                    break
                await asyncio.sleep(0.01)
            assert consumer.stats.batches == 1 and consumer.stats.answered["ok"] == 0
            await send(kafka_settings, topics(kafka_settings).requests(MODEL), [dict(original, text="sent again")])
            results = await collect(
                kafka_settings, topics(kafka_settings).results(MODEL), {original["id"]}, grace_s=1.0
            )
            dead = await consume_n(kafka_settings, topics(kafka_settings).dlq, 1, timeout_s=10)
        assert len(results.by_id[original["id"]]) == 1 and results.by_id[original["id"]][0]["outcome"] == "ok"
        (letter,) = json_values(dead)
        assert letter["reason"] == "duplicate" and "running" in letter["detail"]
        assert consumer.stats.batches == 1

    asyncio.run(scenario())


def test_a_batch_event_carries_the_dispatch_record_as_the_engine_wrote_it() -> None:
    record = DispatchRecord(
        batch_id=7,
        size=3,
        cost=41,
        reason="max_wait",
        window_ms=12.5,
        hit_target=True,
        marked_count=2,
        oldest_wait_ms=33.25,
        queue_depth=9,
        effective_cap=24,
        arrival_rate_per_s=180.5,
        dispatch_ms=1.0,
        cap_reason="knee",
        target_size=16,
    )
    timing = BatchTiming(
        dispatch_ms=1000,
        compute_start_ms=1001,
        compute_end_ms=1020,
        produce_ms=1021,
        device_mem_bytes=4096,
        device_mem_kind="process_rss",
    )
    answers = Answers("m", "c1", Topics("p"), TopicLimits(KafkaSettings()))
    message = answers.batch(Batch(7, [], record), timing, compute_ms=19.0, tokens_in=30, tokens_out=0)
    event = json.loads(message.value)
    assert {name: event[name] for name in DECISION_FIELDS} == {name: getattr(record, name) for name in DECISION_FIELDS}
    assert (event["batch_id"], event["size"], event["dispatch_ms"], event["compute_ms"]) == (7, 0, 1000, 19.0)
    assert (event["model"], event["consumer_id"], event["device_mem_bytes"]) == ("m", "c1", 4096)
