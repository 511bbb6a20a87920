"""Where a running sink serves its embedded store, so readers find it from the config alone.

The sink publishes `<data_dir>/batchtide-live.json` (URL, user, its pid, and
the password when it made one up) once its read-only server is up, and
removes it when it stops. A reader of the same config finds the file, checks
that the process still lives and the server answers, and reads over HTTP
instead of trying to open a directory the sink holds.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import clickhouse_connect
import psutil
from clickhouse_connect.driver.client import Client

from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.http_server import Credentials, LiveServer, wait_until_up

LIVE_FILE = "batchtide-live.json"
PASSWORD_ENV = "BATCHTIDE_CLICKHOUSE_READ_PASSWORD"
log = logging.getLogger("batchtide.sink")


@dataclass(frozen=True)
class Endpoint:
    url: str
    user: str
    password: str
    pid: int


def live_file(settings: ClickHouseSettings) -> Path:
    return Path(settings.data_dir).resolve() / LIVE_FILE


def find(settings: ClickHouseSettings) -> Endpoint | None:
    """The live server of a running sink on this embedded store, or None (no sink, or a stale file)."""
    path = live_file(settings)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    password = data.get("password") or os.environ.get(PASSWORD_ENV, "")
    endpoint = Endpoint(url=data["url"], user=data["user"], password=password, pid=int(data["pid"]))
    if not psutil.pid_exists(endpoint.pid) or not wait_until_up(endpoint.url, timeout_s=2.0):
        return None
    return endpoint


def connect_live(endpoint: Endpoint, database: str | None) -> Client:
    return clickhouse_connect.get_client(
        dsn=endpoint.url, username=endpoint.user, password=endpoint.password, database=database
    )


class Published:
    """A sink's running server and its live file; `close()` withdraws both."""

    def __init__(self, settings: ClickHouseSettings) -> None:
        password = os.environ.get(PASSWORD_ENV) or secrets.token_urlsafe(18)
        self.path = live_file(settings)
        self.server = LiveServer(
            Path(settings.data_dir),
            settings.http_host,
            settings.http_port,
            Credentials(settings.http_user, password),
            settings.database,
        ).start()
        record = {"url": self.server.url, "user": settings.http_user, "pid": os.getpid()}
        if not os.environ.get(PASSWORD_ENV):
            record["password"] = password
        staging = self.path.with_name(f".{LIVE_FILE}.{os.getpid()}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(record))
        staging.replace(self.path)
        log.info("read-only ClickHouse HTTP interface on %s (user %s)", self.server.url, settings.http_user)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self.server.stop()


def publish(settings: ClickHouseSettings) -> Published | None:
    """Start the read-only server for a sink on the embedded store (None: a server URL, or turned off)."""
    if settings.url or not settings.serve_http:
        return None
    return Published(settings)
