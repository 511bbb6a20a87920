"""One way to reach ClickHouse: the embedded engine (chDB) or a server over HTTP.

Everything above this module talks to a clickhouse-connect `Client`; whether
the engine runs in this process (`url = ""`, the default) or behind an HTTP
URL is decided here and nowhere else, so the sink, migrations and `report`
share one code path.

chDB runs the real ClickHouse engine inside the process and allows one data
directory per process at a time: clients on the same directory share it, and
opening a second directory while a client is open fails. Tests therefore use
one session-wide directory and a fresh database per test.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ProgrammingError

from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.identifiers import checked_identifier
from pipeline.core.store.live import connect_live, find


class ClickHouseUnavailable(RuntimeError):
    """The configured ClickHouse could not be reached or opened; the message says which."""


def describe(settings: ClickHouseSettings) -> str:
    """Where the data lives, for log lines (never includes credentials)."""
    if settings.url:
        return re.sub(r"//[^@/]*@", "//", settings.url)
    return f"embedded chDB at {Path(settings.data_dir).resolve()}"


def scalar_int(client: Client, sql: str, parameters: dict[str, Any] | None = None) -> int:
    """The one number a query returns (a count): `Client.command` may also return a row or a summary."""
    value = client.command(sql, parameters=parameters)
    if not isinstance(value, int | str):
        raise TypeError(f"expected one number from {sql!r}, got {value!r}")
    return int(value)


def connect(settings: ClickHouseSettings, *, database: str | None = None) -> Client:
    """Open a client; `database` must exist already (None: the engine's default)."""
    if database is not None:
        checked_identifier(database)
    try:
        if not settings.url:
            data_dir = Path(settings.data_dir).resolve()
            data_dir.mkdir(parents=True, exist_ok=True)
            return clickhouse_connect.get_client(dsn=f"chdb://{data_dir}", database=database)
        return clickhouse_connect.get_client(
            dsn=settings.url,
            username=os.environ.get("BATCHTIDE_CLICKHOUSE_USER") or None,
            password=os.environ.get("BATCHTIDE_CLICKHOUSE_PASSWORD", ""),
            database=database,
        )
    except ProgrammingError as e:
        raise ClickHouseUnavailable(f"cannot open {describe(settings)}: {e}") from e
    except Exception as e:  # network, auth, unknown database: all mean "not usable now"
        raise ClickHouseUnavailable(f"cannot connect to {describe(settings)}: {e}") from e


def connect_reader(settings: ClickHouseSettings, *, database: str | None = None) -> Client:
    """A client for reading (report, board): while a sink holds the embedded store, its read-only
    HTTP server (pipeline/core/store/live.py); otherwise the same as `connect`."""
    if not settings.url:
        endpoint = find(settings)
        if endpoint is not None:
            if database is not None:
                checked_identifier(database)
            try:
                return connect_live(endpoint, database)
            except Exception as e:
                raise ClickHouseUnavailable(f"cannot read the running sink's store at {endpoint.url}: {e}") from e
    return connect(settings, database=database)
