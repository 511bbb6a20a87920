"""ClickHouse fixtures: the real engine (chDB, in this process) for the whole session.

chDB opens one data directory per process: clients on that directory share
it, and opening another one while a client is open fails. So the session has
one directory (`clickhouse_settings.data_dir`), one migrated client on it
(`clickhouse_client`), and isolation between tests comes from databases:
`ch_database` gives each test a fresh, migrated database and drops it after.
Any test that needs its own client must connect with `clickhouse_settings`.

`seeded_clickhouse` is one deterministic seeded database shared by the
session (the dashboard and report tests read it; nobody writes to it).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from clickhouse_connect.driver.client import Client

from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.connection import ClickHouseUnavailable, connect
from pipeline.core.store.lag_writer import insert_lag_events
from pipeline.core.store.migrations import Layout, migrate
from pipeline.core.store.seed import SeedChunk, SeedSummary, generate, insert_chunk, recent_start_ms
from tests.support.lag_seed import lag_samples

SEED_ROWS = 120_000
SEED = 11
SEED_DURATION_MS = 10 * 60_000


@dataclass(frozen=True)
class SeededClickHouse:
    """A read-only seeded database: query it with `client` (default database = `database`)."""

    client: Client
    database: str
    settings: ClickHouseSettings
    time_from_ms: int
    """Earliest enqueue time in the data; use [time_from_ms, time_to_ms] as the panel range."""
    time_to_ms: int
    """Latest produce time in the data, rounded up to the next second."""
    summary: SeedSummary
    chunks: tuple[SeedChunk, ...]
    """The generated rows themselves, for computing expected figures independently."""


OPEN_ENGINE = re.compile(r"already initialized with path '([^']+)'")


def _engine_directory(wanted: str) -> str:
    """`wanted`, unless another fixture of this process already opened chDB elsewhere: then that one.

    chDB refuses a second directory while a client is open; databases keep
    tests apart either way, so sharing the open directory is safe.
    """
    try:
        probe = connect(ClickHouseSettings(data_dir=wanted))
    except ClickHouseUnavailable as e:
        match = OPEN_ENGINE.search(str(e))
        if match is None:
            raise
        return match.group(1)
    probe.close()
    return wanted


@pytest.fixture(scope="session")
def clickhouse_settings(tmp_path_factory: pytest.TempPathFactory) -> ClickHouseSettings:
    """Embedded engine in a session temp dir; database `batchtide` (tests use their own, see ch_database)."""
    return ClickHouseSettings(data_dir=_engine_directory(str(tmp_path_factory.mktemp("chdb"))), database="batchtide")


@pytest.fixture(scope="session")
def clickhouse_client(clickhouse_settings: ClickHouseSettings) -> Iterator[Client]:
    """A client on the session engine, with `clickhouse_settings.database` migrated."""
    client = connect(clickhouse_settings)
    migrate(client, Layout(clickhouse_settings.database))
    yield client
    client.close()


@pytest.fixture
def ch_database(clickhouse_client: Client) -> Iterator[str]:
    """A fresh migrated database for one test, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    migrate(clickhouse_client, Layout(name))
    yield name
    clickhouse_client.command(f"DROP DATABASE IF EXISTS {name} SYNC")


@pytest.fixture(scope="session")
def seeded_clickhouse(clickhouse_client: Client, clickhouse_settings: ClickHouseSettings) -> Iterator[SeededClickHouse]:
    """SEED_ROWS deterministic rows (two models, 10 minutes ending at the current minute, busy and idle phases)."""
    database = "seeded"
    clickhouse_client.command(f"DROP DATABASE IF EXISTS {database} SYNC")
    migrate(clickhouse_client, Layout(database))
    chunks = tuple(
        generate(SEED_ROWS, seed=SEED, start_ms=recent_start_ms(SEED_DURATION_MS), duration_ms=SEED_DURATION_MS)
    )
    for chunk in chunks:
        insert_chunk(clickhouse_client, database, chunk)
    low = min(min(c.latency["enqueue_time"]) for c in chunks)
    high = max(max(c.latency["produce_time"]) for c in chunks)
    models = tuple(sorted({c.latency["model"][0] for c in chunks}))
    insert_lag_events(clickhouse_client, database, lag_samples(models, low, high))
    summary = SeedSummary(
        rows=SEED_ROWS,
        batches=sum(len(c.batches["batch_id"]) for c in chunks),
        models=tuple(sorted({c.latency["model"][0] for c in chunks})),
        time_from_ms=low,
        time_to_ms=high,
    )
    settings = dataclasses.replace(clickhouse_settings, database=database)
    client = connect(settings, database=database)
    yield SeededClickHouse(
        client=client,
        database=database,
        settings=settings,
        time_from_ms=low,
        time_to_ms=(high // 1000 + 1) * 1000,
        summary=summary,
        chunks=chunks,
    )
    client.close()
