"""Consumer lag against the real broker and a real consumer: offsets and CreateTime read from
Kafka, the recorder's events, `batchtide status` and `batchtide results`."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from typer.testing import CliRunner

from consumers.lag import LagProbe, lag_recorder, latest_lag_events
from pipeline.cli import app
from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, client_options
from schemas.messages import LagEvent
from tests.consumers.harness import MODEL, cost_model, create_topics, make_consumer, request, running
from tests.support.kafka import produce_json

pytestmark = pytest.mark.kafka


async def _until(check, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s} s")
        await asyncio.sleep(0.1)


async def _lag_events(kafka: KafkaSettings) -> list[LagEvent]:
    topic = Topics(kafka.topic_prefix).lag_events
    reader = AIOKafkaConsumer(topic, **client_options(kafka), auto_offset_reset="earliest", enable_auto_commit=False)
    await reader.start()
    try:
        got = await reader.getmany(timeout_ms=2000)
        return [msgspec.json.decode(r.value, type=LagEvent) for records in got.values() for r in records]
    finally:
        await reader.stop()


def _config_file(tmp_path: Path, kafka: KafkaSettings, interval_ms: float = 300.0) -> Path:
    path = tmp_path / "batchtide.toml"
    path.write_text(
        f'[models.{MODEL}]\nrunner = "cost-model"\npartitions = 2\n\n'
        f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\ntopic_prefix = "{kafka.topic_prefix}"\n\n'
        f"[consumer]\nlag_interval_ms = {interval_ms}\n"
    )
    return path


def test_lag_and_lag_age_come_from_committed_offsets_and_create_time(kafka_settings: KafkaSettings) -> None:
    model = cost_model(partitions=2)
    topics = Topics(kafka_settings.topic_prefix)
    group = topics.group(MODEL)

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        sent = await produce_json(kafka_settings, topics.requests(MODEL), [request(i) for i in range(6)], partition=0)
        sent += await produce_json(
            kafka_settings, topics.requests(MODEL), [request(i, "s") for i in range(3)], partition=1
        )
        await asyncio.sleep(1.0)
        async with LagProbe(kafka_settings) as probe:
            partitions = await probe.topic_partitions([topics.requests(MODEL), topics.priority(MODEL)])
            assert [(tp.topic, tp.partition) for tp in partitions] == [
                (topics.requests(MODEL), 0), (topics.requests(MODEL), 1),
                (topics.priority(MODEL), 0), (topics.priority(MODEL), 1),
            ]  # fmt: skip
            before = time.time() * 1000
            lags = await probe.measure(group, partitions)
            first_times = {0: sent[0].timestamp, 1: sent[6].timestamp}
            for row in lags[:2]:
                assert row.committed_offset == -1, "nothing committed yet"
                assert row.lag == (6 if row.partition == 0 else 3) == row.end_offset
                assert row.oldest_ms == first_times[row.partition], "age comes from the first record's CreateTime"
                assert row.lag_age_ms >= before - first_times[row.partition] >= 1000
            assert [(r.lag, r.lag_age_ms) for r in lags[2:]] == [(0, 0.0), (0, 0.0)]

            consumer = make_consumer(model, kafka_settings)
            async with running(consumer):
                await _until(lambda: _answered(consumer, 9), what="all answered")
                await _until(lambda: _lag_is(probe, group, partitions[:2], 0), what="committed to the end")
            after = await probe.measure(group, partitions[:2])
            assert [(r.committed_offset, r.lag, r.oldest_ms, r.lag_age_ms) for r in after] == [
                (6, 0, 0, 0.0),
                (3, 0, 0, 0.0),
            ]

    asyncio.run(scenario())


async def _answered(consumer, n: int) -> bool:
    return sum(consumer.stats.answered.values()) >= n


async def _lag_is(probe: LagProbe, group: str, partitions: list[TopicPartition], lag: int) -> bool:
    return sum(r.lag for r in await probe.measure(group, partitions)) == lag


def test_recorder_publishes_lag_while_a_slow_consumer_falls_behind(kafka_settings: KafkaSettings) -> None:
    # 300 ms per batch of at most 2: 40 requests take ~6 s, so samples see lag and a growing age.
    model = cost_model(partitions=2, a_ms=300.0, c_ms=0.0, hard_cap=2, target_size=2, adaptive_cap=False)
    topics = Topics(kafka_settings.topic_prefix)

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        consumer = make_consumer(model, kafka_settings)
        async with running(consumer):
            recorder = lag_recorder(consumer, kafka_settings, 300.0)
            assert recorder is not None
            recorder.start()
            try:
                await produce_json(kafka_settings, topics.requests(MODEL), [request(i) for i in range(40)])
                await _until(lambda: _answered(consumer, 40), what="all answered")
                await _until(lambda: _recorded_zero(recorder), what="a sample with no lag")
            finally:
                await recorder.stop()
        events = [e for e in await _lag_events(kafka_settings) if e.consumer_id == consumer.consumer_id]
        assert len(events) >= 5
        behind = [e for e in events if sum(p.lag for p in e.partitions) > 0]
        assert behind, "samples taken while the backlog drained show it"
        ages = [max(p.lag_age_ms for p in e.partitions) for e in behind]
        assert max(ages) >= 1000.0, f"the oldest waiting record aged past a second: {ages}"
        assert all(e.group == topics.group(MODEL) and e.model == MODEL for e in events)
        assert {(p.topic, p.partition) for p in events[-1].partitions} == {
            (t, p) for t in (topics.requests(MODEL), topics.priority(MODEL)) for p in (0, 1)
        }, "the consumer reports every partition it owns"
        last = events[-1]
        assert last.batches >= 20 and last.last_batch_ms > 0 and last.effective_cap == 2
        latest = await latest_lag_events(kafka_settings, max_age_ms=60_000)
        assert latest[consumer.consumer_id].ts_ms == max(e.ts_ms for e in events)

    asyncio.run(scenario())


async def _recorded_zero(recorder) -> bool:
    last = recorder.last
    return last is not None and last.partitions and sum(p.lag for p in last.partitions) == 0


def test_status_shows_members_partitions_lag_and_engine_state(kafka_settings: KafkaSettings, tmp_path: Path) -> None:
    model = cost_model(partitions=2, a_ms=400.0, c_ms=0.0, hard_cap=1, target_size=1, adaptive_cap=False)
    topics = Topics(kafka_settings.topic_prefix)
    config = _config_file(tmp_path, kafka_settings)
    outputs: dict[str, str] = {}

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        consumer = make_consumer(model, kafka_settings, name="status-c1")
        async with running(consumer):
            recorder = lag_recorder(consumer, kafka_settings, 300.0)
            assert recorder is not None
            recorder.start()
            try:
                await produce_json(kafka_settings, topics.requests(MODEL), [request(i) for i in range(30)], partition=1)
                await _until(lambda: _recorded_lag(recorder), what="a sample with lag")
                result = await asyncio.to_thread(CliRunner().invoke, app, ["status", "--config", str(config)])
                assert result.exit_code == 0, result.output
                outputs["text"] = result.output
                result = await asyncio.to_thread(CliRunner().invoke, app, ["status", "--config", str(config), "--json"])
                assert result.exit_code == 0, result.output
                outputs["json"] = result.output
            finally:
                await recorder.stop()

    asyncio.run(scenario())
    view = json.loads(outputs["json"])
    assert view["sink"]["members"] == 0 and view["sink"]["lag"] > 0, "no sink runs: the lag events wait in Kafka"
    (status,) = view["models"]
    assert status["state"] == "Stable" and [m["client_id"] for m in status["members"]] == ["status-c1"]
    assert sorted(status["members"][0]["partitions"]) == sorted(
        f"{t}:{p}" for t in (topics.requests(MODEL), topics.priority(MODEL)) for p in (0, 1)
    )
    rows = {(p["topic"], p["partition"]): p for p in status["partitions"]}
    hot = rows[(topics.requests(MODEL), 1)]
    assert hot["end_offset"] == 30 and 0 < hot["lag"] <= 30 and hot["lag_age_ms"] > 0 and hot["owner"] == "status-c1"
    assert rows[(topics.requests(MODEL), 0)]["lag"] == 0
    engine = status["consumers"]["status-c1"]
    assert engine["effective_cap"] == 1 and engine["batches"] >= 1 and engine["last_batch_ms"] > 0
    text = outputs["text"]
    assert f"model {MODEL}  group {topics.group(MODEL)}  state Stable  members 1" in text
    assert f"sink group {kafka_settings.topic_prefix}-sink  state " in text
    assert "member status-c1" in text and "learned cap 1" in text and "last batch" in text
    assert status["members"][0]["partition_share"] == 1.0, "the only member holds every partition"
    assert status["members"][0]["arrival_share"] in (1.0, None), "all of the arrivals, when its rate is above 0"
    assert "capacity/s" in text and "partitions" in text
    assert f"{topics.requests(MODEL)}:1" in text


async def _recorded_lag(recorder) -> bool:
    last = recorder.last
    return last is not None and last.batches >= 1 and sum(p.lag for p in last.partitions) > 0


def test_results_prints_one_readable_line_per_answer(kafka_settings: KafkaSettings, tmp_path: Path) -> None:
    model = cost_model(partitions=2)
    topics = Topics(kafka_settings.topic_prefix)
    config = str(_config_file(tmp_path, kafka_settings))

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        consumer = make_consumer(model, kafka_settings)
        async with running(consumer):
            await produce_json(kafka_settings, topics.requests(MODEL), [request(i) for i in range(5)])
            await produce_json(kafka_settings, topics.requests(MODEL), [{"id": "bad-1", "model": MODEL}])
            await _until(lambda: _answered(consumer, 6), what="all answered")

    asyncio.run(scenario())
    time.sleep(1.5)
    runner = CliRunner()
    plain = runner.invoke(app, ["results", "--model", MODEL, "--config", config])
    assert plain.exit_code == 0, plain.output
    lines = plain.output.strip().splitlines()
    assert len(lines) == 6
    ok = [line for line in lines if "  ok  " in line]
    assert len(ok) == 5 and all("embedding dim" in line and "norm" in line and "batch " in line for line in ok)
    assert all(len(line) < 200 for line in lines), "a person can read every line"
    (bad,) = [line for line in lines if "bad-1" in line]
    assert "rejected" in bad and "reason:" in bad and "no batch" in bad

    full = runner.invoke(app, ["results", "--model", MODEL, "--config", config, "--json"])
    records = [json.loads(line) for line in full.output.strip().splitlines()]
    assert len(records) == 6 and all(r["e2e_ms"] >= 0 for r in records)
    dims = {len(r["embedding"]) for r in records if r["outcome"] == "ok"}
    assert len(dims) == 1 and f"embedding dim {dims.pop()}" in ok[0]

    one = runner.invoke(app, ["results", "--model", MODEL, "--config", config, "--id", "r3"])
    assert one.exit_code == 0 and len(one.output.strip().splitlines()) == 1 and " r3 " in one.output
    missing = runner.invoke(app, ["results", "--model", MODEL, "--config", config, "--id", "nope"])
    assert missing.exit_code == 1
    later = runner.invoke(app, ["results", "--model", MODEL, "--config", config, "--since", "1s"])
    assert later.exit_code == 0 and later.output.strip() == "", "nothing was answered in the last second"
    earlier = runner.invoke(app, ["results", "--model", MODEL, "--config", config, "--since", "10m"])
    assert len(earlier.output.strip().splitlines()) == 6
