"""The sink loads lag events from `<prefix>.events.lag` into `consumer_lag` (real broker, real
engine): one row per partition, a replayed sample stored once, garbage dropped and counted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
from clickhouse_connect.driver.client import Client

from pipeline.core.config import ClickHouseSettings, KafkaSettings
from pipeline.core.kafka.client import Topics, create_topics
from pipeline.core.store.connection import connect, scalar_int
from pipeline.sink.app import build_sink
from tests.store.test_lag_store import T0, lag_event
from tests.store.test_sink import _produce, _running, _sink_config, _until

pytestmark = pytest.mark.kafka


def test_sink_stores_lag_samples_once(
    kafka_settings: KafkaSettings, clickhouse_settings: ClickHouseSettings, ch_database: str,
    clickhouse_client: Client, tmp_path: Path,
) -> None:  # fmt: skip
    config = _sink_config(kafka_settings, clickhouse_settings, ch_database, events_partitions=1, insert_batch_size=50)
    kafka, clickhouse, topics = config.kafka, config.clickhouse, Topics(config.kafka.topic_prefix)
    events = [lag_event(f"c{i % 3}", T0 + i * 1_000, {0: i, 1: 2 * i}, age_ms=100.0 * i) for i in range(30)]
    events.append(lag_event("idle", T0 + 500, {}))
    values = [msgspec.json.encode(e) for e in events]

    def rows() -> int:
        return scalar_int(
            clickhouse_client, f"SELECT count() FROM {ch_database}.consumer_lag WHERE source = 'consumer'"
        )

    async def scenario() -> None:
        await create_topics(kafka, dict.fromkeys((topics.latency_events, topics.batch_events, topics.lag_events), 1))
        await _produce(kafka, topics.lag_events, values + values[:10] + [b"{not a lag event"])
        sink = build_sink(config, connect=lambda: connect(clickhouse, database=ch_database), datadir=str(tmp_path))
        lags = sink.lags
        assert lags is not None

        async def body() -> None:
            await _until(lambda: lags.stats.received == len(values) + 10 and lags.buffered == 0,
                         what="every copy consumed")  # fmt: skip
            await _until(lambda: sink.rejected == 1, what="garbage rejected")

        started = time.monotonic()
        await _running(sink, body)
        assert time.monotonic() - started < 120

    asyncio.run(scenario())
    assert rows() == 30 * 2 + 1, "one row per partition of each sample; the idle consumer's state row"
    stored = clickhouse_client.query(
        f"SELECT sum(lag), max(lag_age_ms), countIf(partition = -1) FROM {ch_database}.consumer_lag WHERE source = 'consumer'"
    ).result_rows[0]
    assert stored == (sum(3 * i for i in range(30)), 2_900.0, 1)
