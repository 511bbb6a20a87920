"""Live analysis on the embedded store: the sink's read-only ClickHouse HTTP interface.

In this process: the server on the session's engine, spoken to by
clickhouse-connect's HTTP client and by plain HTTP. End to end: a real
`batchtide sink` process holding its own data directory while `batchtide
report` answers from it and writes are refused.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gzip
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import clickhouse_connect
import msgspec
import pytest
from aiokafka import AIOKafkaProducer

from pipeline.core.config import ClickHouseSettings, KafkaSettings
from pipeline.core.kafka.client import Topics, client_options, create_topics
from pipeline.core.store.http_server import Credentials, LiveServer
from pipeline.core.store.live import LIVE_FILE, find
from pipeline.core.store.seed import generate, latency_events, recent_start_ms
from pipeline.tools.harness.config_file import kafka_table, toml_text
from pipeline.tools.harness.processes import SINK_ENV, Proc, child_env, cli, sink_argv
from tests.support.clickhouse import SeededClickHouse

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "reader", "live-test-pw"


@pytest.fixture(scope="module")
def server(seeded_clickhouse: SeededClickHouse) -> Iterator[LiveServer]:
    live = LiveServer(
        Path(seeded_clickhouse.settings.data_dir),
        "127.0.0.1",
        0,
        Credentials(USER, PASSWORD),
        seeded_clickhouse.database,
    ).start()
    yield live
    live.stop()


def _http(
    server: LiveServer, body: str | None = None, headers: dict[str, str] | None = None, **params: str
) -> tuple[int, dict[str, str], bytes]:
    auth = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    request = urllib.request.Request(
        f"{server.url}/?{urlencode(params)}",
        data=None if body is None else body.encode(),
        headers={"Authorization": f"Basic {auth}", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_clickhouse_connect_reads_what_the_engine_holds(
    server: LiveServer, seeded_clickhouse: SeededClickHouse
) -> None:
    client = clickhouse_connect.get_client(host="127.0.0.1", port=server.port, username=USER, password=PASSWORD)
    sql = "SELECT model, count() AS n, max(enqueue_time) AS last FROM request_latency GROUP BY model ORDER BY model"
    assert client.query(sql).result_rows == seeded_clickhouse.client.query(sql).result_rows
    model = seeded_clickhouse.summary.models[0]
    bound = "SELECT count() FROM request_latency WHERE model = {model:String}"
    assert (
        client.query(bound, parameters={"model": model}).result_rows
        == seeded_clickhouse.client.query(bound, parameters={"model": model}).result_rows
    )
    assert client.query(
        "SELECT count() FROM request_latency WHERE model = %(m)s", parameters={"m": "nope"}
    ).result_rows == [(0,)]
    frame = client.query_np("SELECT e2e_ms FROM request_latency LIMIT 5")
    assert len(frame) == 5


def test_plain_http_formats_parameters_and_compression(server: LiveServer, seeded_clickhouse: SeededClickHouse) -> None:
    status, headers, body = _http(server, query="SELECT count() AS n FROM request_latency FORMAT JSONEachRow")
    assert status == 200 and headers["X-ClickHouse-Format"] == "JSONEachRow"
    assert json.loads(body)["n"] == seeded_clickhouse.summary.rows
    status, headers, body = _http(server, "SELECT {x:UInt32} * 2 AS y", default_format="TSVWithNames", param_x="21")
    assert (status, body) == (200, b"y\n42\n")
    status, headers, body = _http(
        server, "SELECT currentDatabase()", headers={"X-ClickHouse-Format": "CSV", "X-ClickHouse-Database": "system"}
    )
    assert (status, headers["X-ClickHouse-Format"], body) == (200, "CSV", b'"system"\n')
    status, headers, body = _http(
        server, "SELECT 1", headers={"Accept-Encoding": "gzip"}, enable_http_compression="1", database="system"
    )
    assert headers.get("Content-Encoding") == "gzip" and gzip.decompress(body) == b"1\n"


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO request_latency (request_id) VALUES ('x')",
        "DROP TABLE request_latency",
        "ALTER TABLE request_latency DELETE WHERE 1",
        "SELECT 1 INTO OUTFILE '/tmp/batchtide-live-test.txt'",
        "SELECT * FROM file('/etc/hostname', 'LineAsString')",
        "SELECT 1; DROP TABLE request_latency",
        "SELECT 1 SETTINGS readonly = 0",
        "/* hide */ TRUNCATE TABLE request_latency",
        "SELECT '--', 1 INTO OUTFILE '/tmp/batchtide-live-test.txt'",
        "SELECT 1 -- it's\n INTO OUTFILE '/tmp/batchtide-live-test.txt'",
    ],
)
def test_writes_are_refused(server: LiveServer, seeded_clickhouse: SeededClickHouse, sql: str) -> None:
    before = seeded_clickhouse.client.command("SELECT count() FROM request_latency")
    status, headers, body = _http(server, sql)
    assert status >= 400
    assert headers["X-ClickHouse-Exception-Code"] != "0" and body.startswith(b"Code: ")
    assert seeded_clickhouse.client.command("SELECT count() FROM request_latency") == before
    assert not Path("/tmp/batchtide-live-test.txt").exists()


def test_wrong_password_is_refused(server: LiveServer) -> None:
    with pytest.raises(Exception, match="516"):
        clickhouse_connect.get_client(host="127.0.0.1", port=server.port, username=USER, password="wrong")


def test_loopback_by_default() -> None:
    assert ClickHouseSettings().http_host == "127.0.0.1"


# -- end to end: a sink process holding its own store ------------------------------------------


def _cli(*args: str, config: Path) -> list[str]:
    return cli(*args, "--config", str(config))


@pytest.mark.kafka
def test_report_answers_live_while_the_sink_runs(kafka_settings: KafkaSettings, tmp_path: Path) -> None:
    data_dir = tmp_path / "clickhouse"
    config = tmp_path / "batchtide.toml"
    config.write_text(toml_text({
        "kafka": kafka_table(kafka_settings, events_partitions=1),
        "clickhouse": {"url": "", "data_dir": str(data_dir), "insert_interval_ms": 200.0},
    }))  # fmt: skip
    chunk = next(iter(generate(300, seed=5, start_ms=recent_start_ms(60_000), duration_ms=60_000)))
    events = latency_events(chunk)
    topics = Topics(kafka_settings.topic_prefix)
    unset = ("BATCHTIDE_CLICKHOUSE_READ_PASSWORD", "BATCHTIDE_CLICKHOUSE_URL")
    env = child_env(SINK_ENV, drop=unset)

    async def produce() -> None:
        await create_topics(kafka_settings, {topics.latency_events: 1, topics.batch_events: 1})
        producer = AIOKafkaProducer(**client_options(kafka_settings), acks="all")
        await producer.start()
        try:
            for event in events:
                await producer.send(topics.latency_events, msgspec.json.encode(event))
            await producer.flush()
        finally:
            await producer.stop()

    asyncio.run(produce())
    sink = Proc("sink", sink_argv(config), tmp_path, SINK_ENV, drop_env=unset)
    sink.start()
    settings = ClickHouseSettings(data_dir=str(data_dir))
    try:
        deadline = time.monotonic() + 120
        report: dict = {}
        while time.monotonic() < deadline:
            assert sink.alive, sink.log_tail()
            if (data_dir / LIVE_FILE).exists():
                done = subprocess.run(
                    _cli("report", "--since", "1h", "--json", config=config),
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=ROOT,
                )
                assert done.returncode == 0, done.stderr
                report = json.loads(done.stdout)
                if sum(row["requests"] for row in report["sections"]["summary"]) == len(events):
                    break
            time.sleep(1.0)
        assert sum(row["requests"] for row in report["sections"]["summary"]) == len(events), report

        board = tmp_path / "board.html"
        done = subprocess.run(
            _cli("board", "--since", "1h", "--out", str(board), config=config),
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        page = board.read_text()
        assert all(model in page for model in {e.model for e in events}), "the board drew the live store's models"

        endpoint = find(settings)
        assert endpoint is not None and endpoint.pid == sink.pid
        assert oct((data_dir / LIVE_FILE).stat().st_mode & 0o777) == "0o600", "the live file holds a password"
        client = clickhouse_connect.get_client(
            dsn=endpoint.url, username=endpoint.user, password=endpoint.password, database="batchtide"
        )
        assert client.command("SELECT count() FROM request_latency FINAL") == len(events)
        with pytest.raises(Exception, match="164"):
            client.command("INSERT INTO request_latency (request_id, model) VALUES ('intruder', 'm')")
        assert client.command("SELECT count() FROM request_latency WHERE request_id = 'intruder'") == 0
    finally:
        sink.terminate(timeout_s=60)
    assert not (data_dir / LIVE_FILE).exists(), "a stopped sink withdraws its live file"
    assert find(dataclasses.replace(settings)) is None
