"""The consumers' latency events as a harness reads them back: from the events topic, or as the
rows the sink stored in an embedded ClickHouse."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

import msgspec

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics
from pipeline.core.kafka.reader import Record, TopicReader
from pipeline.tools.harness.errors import HarnessError
from pipeline.tools.harness.processes import REPO_ROOT

_COUNT_ROWS = """
import json, sys
from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.connection import connect
client = connect(ClickHouseSettings(data_dir=sys.argv[1]), database=sys.argv[2])
raw = client.query("SELECT request_id, count() FROM request_latency GROUP BY request_id").result_rows
final = client.query("SELECT count() FROM request_latency FINAL").result_rows[0][0]
print(json.dumps({"raw_per_id": {r[0]: r[1] for r in raw}, "final_rows": final}))
"""
"""Run in a child process: chDB lets one process open a data directory, and a
harness may need several directories in one run."""


async def latency_events(kafka: KafkaSettings, wanted: Collection[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """The first latency event of each wanted request id, read from the topic's start until all
    are there or `timeout_s` has passed."""
    events: dict[str, dict[str, Any]] = {}

    def keep(record: Record) -> None:
        event = json.loads(record.value)
        rid = event["request_id"]
        if rid in wanted and rid not in events:
            events[rid] = event

    async with TopicReader(kafka, Topics(kafka.topic_prefix).latency_events) as reader:
        await reader.read(keep, until=lambda: len(events) >= len(wanted), timeout_s=timeout_s, poll_ms=500)
    return events


async def stored_rows(clickhouse_dir: Path, database: str = "batchtide") -> dict[str, Any]:
    """{"raw_per_id": {request id: latency rows}, "final_rows": rows after FINAL} of an embedded
    store (no other process may have it open)."""
    command = [sys.executable, "-c", _COUNT_ROWS, str(clickhouse_dir), database]
    done = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False
    )
    if done.returncode != 0:
        raise HarnessError(f"counting ClickHouse rows failed:\n{done.stderr[-2000:]}")
    counts: dict[str, Any] = msgspec.json.decode(done.stdout.strip().splitlines()[-1])
    return counts
