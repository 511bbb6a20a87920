"""A seeded store for the fleet and refusal views: one slow consumer per model, refused requests on top,
and lag samples carrying each consumer's measured capacity (one consumer never measures one).

`fleet_clickhouse` is session-scoped and read-only; tests/conftest.py registers it for every test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from clickhouse_connect.driver.client import Client

from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.connection import connect
from pipeline.core.store.lag_writer import insert_lag_events
from pipeline.core.store.migrations import Layout, migrate
from pipeline.core.store.seed import FleetSeed, SeedChunk, generate, insert_chunk, recent_start_ms
from schemas.messages import LagEvent, PartitionLag

SLOW = 4.0
"""Each model's `<model>-c1` is this many times slower than its `<model>-c0`."""
REFUSED = 0.03
UNMEASURED = "smollm-c0"


@dataclass(frozen=True)
class FleetStore:
    """The seeded database (query it with `client`), the rows themselves and the range covering them."""

    client: Client
    chunks: tuple[SeedChunk, ...]
    time_from_ms: int
    time_to_ms: int
    capacity: dict[str, float]
    """The capacity each consumer's latest measured lag sample carries (none for `UNMEASURED`)."""


def _capacity_samples(consumers: dict[str, str], low: int, high: int) -> tuple[list[LagEvent], dict[str, float]]:
    """Every 10 s per consumer; the capacity grows as it is measured, the last sample 0 (a restart: not
    measured yet), which must not hide the last measured value. `UNMEASURED` never measures one."""
    events, latest = [], {}
    for n, (consumer, model) in enumerate(sorted(consumers.items())):
        base = 400.0 if consumer.endswith("c0") else 400.0 / SLOW
        stamps = list(range(low, high, 10_000))
        for k, ts in enumerate(stamps):
            capacity = 0.0 if k == len(stamps) - 1 or consumer == UNMEASURED else base + k
            if capacity:
                latest[consumer] = capacity
            events.append(LagEvent(
                ts_ms=ts, model=model, consumer_id=consumer, group=f"g.{model}",
                partitions=[PartitionLag(f"r.{model}", n % 2, 100, 90, 10, ts - 50, 50.0)], queue=1, inflight=0,
                window_ms=5.0, effective_cap=32, cap_reason="knee", marked_share=0.0, arrival_rate_per_s=10.0,
                batches=k, last_batch_ms=ts, dead_letters=0, capacity_per_s=capacity,
            ))  # fmt: skip
    return events, latest


@pytest.fixture(scope="session")
def fleet_clickhouse(clickhouse_client: Client, clickhouse_settings: ClickHouseSettings) -> Iterator[FleetStore]:
    database = f"fleet_{uuid.uuid4().hex[:10]}"
    migrate(clickhouse_client, Layout(database))
    start = recent_start_ms(10 * 60_000)
    chunks = tuple(generate(30_000, seed=4, start_ms=start, duration_ms=10 * 60_000,
                            fleet=FleetSeed(slow_factor=SLOW, refused_share=REFUSED)))  # fmt: skip
    for chunk in chunks:
        insert_chunk(clickhouse_client, database, chunk)
    low = min(min(c.latency["enqueue_time"]) for c in chunks)
    high = max(max(c.latency["produce_time"]) for c in chunks) + 1000
    consumers = {cid: c.latency["model"][0] for c in chunks for cid in set(c.latency["consumer_id"])}
    lag, capacity = _capacity_samples(consumers, low, high)
    insert_lag_events(clickhouse_client, database, lag)
    client = connect(clickhouse_settings, database=database)
    yield FleetStore(client, chunks, low, high, capacity)
    client.close()
    clickhouse_client.command(f"DROP DATABASE IF EXISTS {database} SYNC")
