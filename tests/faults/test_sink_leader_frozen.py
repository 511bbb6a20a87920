"""A broker frozen under a running sink while it leads the events partitions and coordinates the
sink's group: every latency event produced after it thaws still becomes exactly one row.

The freeze outlasts the sink's session, so the group rebalances while the
sink's consumer still believes the frozen broker leads. After a rebalance a
partition with no committed offset (the never-written lag topic here,
faust's assignor topic always) gets its position from a ListOffsets to that
leader; aiokafka retries the NotLeaderForPartition answer without refreshing
its metadata and fetches nothing from that broker meanwhile, so the latency
partition stopped being read for minutes (the `broker-freeze` chaos row left
thousands of events out of ClickHouse). The sink's short metadata age
(`METADATA_MAX_AGE_S`) bounds that stall.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import msgspec
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from clickhouse_connect.driver.client import Client

from pipeline.core.config import ClickHouseSettings, Config
from pipeline.core.kafka.client import Topics, client_options
from pipeline.core.kafka.cluster import group_coordinator
from pipeline.core.store.connection import connect, scalar_int
from pipeline.core.store.seed import generate, latency_events, recent_start_ms
from pipeline.sink.app import build_sink
from pipeline.tools.chaos.deployment import Stage

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
ENCODE = msgspec.json.Encoder().encode
FREEZE_S = 25.0
"""Past the sink's 10 s session, so the group rebalances while the broker is frozen."""
CATCH_UP_S = 45.0
FREEZES = 2
REBALANCE_WAIT_S = 15.0
"""How long after a thaw the sink's group may take to rebalance."""
"""Well under aiokafka's own 5 min metadata age, well over the sink's."""


def _count(client: Client, database: str) -> int:
    return scalar_int(client, f"SELECT uniqExact(request_id) FROM {database}.request_latency")


async def _create_led_by(config: Config, leader: int, brokers: list[int]) -> None:
    """The events topics, one partition each, replicated on every broker with `leader` preferred."""
    topics = Topics(config.kafka.topic_prefix)
    replicas = [leader, *(b for b in brokers if b != leader)]
    admin = AIOKafkaAdminClient(**client_options(config.kafka))
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(name, num_partitions=-1, replication_factor=-1, replica_assignments={0: replicas})
                for name in (topics.latency_events, topics.batch_events, topics.lag_events)
            ]
        )
    finally:
        await admin.close()


async def _produce(config: Config, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(**client_options(config.kafka), acks="all", linger_ms=10)
    await producer.start()
    try:
        for value in values:
            await producer.send(Topics(config.kafka.topic_prefix).latency_events, value)
        await producer.flush()
    finally:
        await producer.stop()


@pytest.mark.timeout(420)
def test_sink_reads_on_after_its_leader_and_coordinator_was_frozen(
    cluster_stage: Stage, clickhouse_settings: ClickHouseSettings, ch_database: str,
    clickhouse_client: Client, tmp_path: Path,
) -> None:  # fmt: skip
    cluster = cluster_stage.cluster
    assert cluster is not None
    config = Config(
        kafka=dataclasses.replace(cluster_stage.kafka, events_partitions=1, replication_factor=3),
        clickhouse=dataclasses.replace(
            clickhouse_settings, database=ch_database, insert_interval_ms=200, group_lag_interval_ms=0
        ),
    )
    chunks = list(generate(1_200, seed=41, start_ms=recent_start_ms(120_000), duration_ms=120_000))
    events = [ENCODE(e) for c in chunks for e in latency_events(c)]
    before, after = events[: len(events) // 2], events[len(events) // 2 :]
    sink = build_sink(
        config, connect=lambda: connect(config.clickhouse, database=ch_database), datadir=str(tmp_path / "faust")
    )

    async def until_stored(n: int, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while _count(clickhouse_client, ch_database) < n:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what}: {_count(clickhouse_client, ch_database)} of {n} rows after {timeout_s:g} s; "
                    f"{sink.status_line()}"
                )
            await asyncio.sleep(0.5)

    async def rebalanced(generation: int) -> bool:
        deadline = time.monotonic() + REBALANCE_WAIT_S
        while sink.app.consumer_generation_id == generation and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        return sink.app.consumer_generation_id != generation

    async def scenario() -> None:
        victim = await group_coordinator(config.kafka, sink.app.conf.id)
        await _create_led_by(config, victim, [n.node_id for n in cluster.nodes])
        await sink.app.start()
        try:
            await _produce(config, before)
            await until_stored(len(before), 90, "before the freeze")
            generation = sink.app.consumer_generation_id
            frozen = victim
            for _ in range(FREEZES):  # a coordinator that moves in time can keep the member: freeze again
                cluster.freeze(frozen)
                try:
                    await asyncio.sleep(FREEZE_S)
                finally:
                    cluster.thaw(frozen)
                if await rebalanced(generation):
                    break
                frozen = await group_coordinator(config.kafka, sink.app.conf.id)
            await _produce(config, after)
            await until_stored(len(events), CATCH_UP_S, "after the thaw")
            assert sink.app.consumer_generation_id != generation, f"no freeze of {FREEZES} rebalanced the sink's group"
        finally:
            await sink.app.stop()
            sink.store.close()

    asyncio.run(scenario())
    assert _count(clickhouse_client, ch_database) == len(events)
    rows = scalar_int(clickhouse_client, f"SELECT count() FROM {ch_database}.request_latency FINAL")
    assert rows == len(events), "one row per event"
