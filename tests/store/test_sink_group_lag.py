"""The sink samples every model's consumer group from the broker (real broker, real engine):
lag, lag age and members with no consumer running, a group found on the broker though the
sink's config does not name its model, a member counted when one joins, and the dead-letter
topic's end offsets."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from clickhouse_connect.driver.client import Client

from pipeline.core.config import ClickHouseSettings, KafkaSettings, parse_config
from pipeline.core.kafka.client import Topics, client_options, create_topics
from pipeline.core.store.connection import connect, scalar_int
from pipeline.sink.app import build_sink
from tests.store.test_sink import _running, _sink_config, _until
from tests.support.kafka import consume_n, produce_json

pytestmark = pytest.mark.kafka


def _latest(client: Client, database: str) -> dict[str, dict[str, Any]]:
    """Each model's newest broker-side sample ('' is the dead-letter topic)."""
    rows = client.query(
        f"""
        SELECT model, argMax(members, ts) AS members, argMax(lag, ts) AS lag, argMax(end_offset, ts) AS end_offset,
               argMax(committed_offset, ts) AS committed, argMax(lag_age_ms, ts) AS age_ms, topic, partition
        FROM {database}.consumer_lag
        WHERE source = 'broker' AND consumer_id = ''
        GROUP BY model, topic, partition
        """
    ).named_results()
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        seen = out.setdefault(
            r["model"], {"members": r["members"], "lag": 0, "end": 0, "age_ms": 0.0, "committed": set()}
        )
        seen["members"] = max(seen["members"], r["members"])
        seen["lag"] += r["lag"]
        seen["end"] += r["end_offset"]
        seen["age_ms"] = max(seen["age_ms"], r["age_ms"])
        seen["committed"].add(r["committed"])
    return out


def test_sink_samples_groups_with_and_without_consumers(
    kafka_settings: KafkaSettings, clickhouse_settings: ClickHouseSettings, ch_database: str,
    clickhouse_client: Client, tmp_path: Path,
) -> None:  # fmt: skip
    config = _sink_config(
        kafka_settings, clickhouse_settings, ch_database, events_partitions=1, group_lag_interval_ms=300.0
    )
    config = dataclasses.replace(config, models=parse_config({"models": {"m": {"runner": "cost-model"}}}).models)
    kafka, topics = config.kafka, Topics(config.kafka.topic_prefix)
    sink = build_sink(config, connect=lambda: connect(config.clickhouse, database=ch_database), datadir=str(tmp_path))
    assert sink.sampler is not None

    async def scenario() -> None:
        await create_topics(kafka, {
            topics.latency_events: 1, topics.batch_events: 1, topics.lag_events: 1, topics.dlq: 2,
            topics.requests("m"): 2, topics.priority("m"): 1, topics.requests("found"): 1, topics.priority("found"): 1,
        })  # fmt: skip
        produced_ms = time.time() * 1000
        await produce_json(kafka, topics.requests("m"), [{"id": f"a{i}"} for i in range(5)], partition=0)
        await produce_json(kafka, topics.requests("m"), [{"id": f"b{i}"} for i in range(3)], partition=1)
        await produce_json(kafka, topics.dlq, [{"letter": i} for i in range(4)], partition=1)
        # a model the sink's config does not name: its group answered 2 of 6 records, then left
        await produce_json(kafka, topics.requests("found"), [{"id": f"f{i}"} for i in range(6)])
        await consume_n(kafka, topics.requests("found"), 2, group_id=topics.group("found"))

        async def body() -> None:
            await _until(lambda: {"m", "found", ""} <= set(_latest(clickhouse_client, ch_database)),
                         what="broker-side samples of both groups and the DLQ")  # fmt: skip
            seen = _latest(clickhouse_client, ch_database)
            assert seen["m"]["members"] == 0 and seen["m"]["lag"] == 8 and seen["m"]["committed"] == {-1}
            assert 0 < seen["m"]["age_ms"] < time.time() * 1000 - produced_ms + 5_000, "the first record's age"
            assert seen["found"]["members"] == 0 and seen["found"]["lag"] == 4
            assert seen[""]["end"] == 4 and seen[""]["lag"] == 0, "the dead-letter topic's end offsets"

            member = AIOKafkaConsumer(topics.requests("m"), **client_options(kafka), group_id=topics.group("m"),
                                      enable_auto_commit=False, auto_offset_reset="earliest")  # fmt: skip
            await member.start()
            try:
                await member.getmany(timeout_ms=1000)
                await _until(lambda: _latest(clickhouse_client, ch_database)["m"]["members"] == 1,
                             what="the member counted")  # fmt: skip
                assert _latest(clickhouse_client, ch_database)["m"]["lag"] == 8, "it committed nothing: still 8 waiting"
            finally:
                await member.stop()

        await _running(sink, body)

    asyncio.run(scenario())
    consumer_rows = scalar_int(
        clickhouse_client, f"SELECT count() FROM {ch_database}.consumer_lag WHERE source = 'consumer'"
    )
    assert consumer_rows == 0, "no consumer ran: every row is the sink's own sample"
