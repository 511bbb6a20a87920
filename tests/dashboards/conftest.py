"""The seeded latency store every dashboards test reads: the session's `seeded_clickhouse`
(tests/support/clickhouse.py), seen as a board time range and a model list."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import pytest

from pipeline.tools.views.panel_data import TimeRange


@dataclass(frozen=True)
class SeededStore:
    client: Any
    window: TimeRange
    """The dashboard time range covering every seeded row."""
    models: tuple[str, ...]

    @property
    def since(self) -> str:
        return datetime.fromtimestamp(self.window.from_ms / 1000, tz=UTC).isoformat(timespec="seconds")

    @property
    def until(self) -> str:
        return datetime.fromtimestamp(self.window.to_ms / 1000, tz=UTC).isoformat(timespec="seconds")

    def url_params(self, model: str) -> str:
        """The board URL query selecting this store's window and a model."""
        return urlencode({"since": self.since, "until": self.until, "model": model})


@pytest.fixture(scope="session")
def seeded_store(seeded_clickhouse: Any) -> SeededStore:
    window = TimeRange(seeded_clickhouse.time_from_ms // 1000 * 1000, seeded_clickhouse.time_to_ms)
    return SeededStore(seeded_clickhouse.client, window, tuple(seeded_clickhouse.summary.models))
