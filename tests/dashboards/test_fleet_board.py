"""The board `batchtide — consumers and outcomes`, Grafana's SQL and the local page, on a store with one
slow consumer per model and refused requests: the slow member stands out, and refusals are counted."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dashboards.charts import format_value
from dashboards.panels import FLEET, MODEL_VARIABLE
from pipeline.core.store.macros import expand_macros
from pipeline.tools.views.board import build_page
from pipeline.tools.views.panel_data import Frame, TimeRange
from tests.support.fleet_store import SLOW, FleetStore

BOARD_FILE = Path(__file__).resolve().parents[2] / "dashboards" / f"{FLEET.uid}.json"


def _window(store: FleetStore) -> TimeRange:
    return TimeRange(store.time_from_ms // 1000 * 1000, store.time_to_ms)


def _grafana(store: FleetStore, title: str, model: str) -> list[dict]:
    """The committed panel's SQL, expanded as the plugin does, run on the store."""
    (panel,) = [p for p in json.loads(BOARD_FILE.read_text())["panels"] if p["title"] == title]
    window = _window(store)
    sql = expand_macros(panel["targets"][0]["rawSql"], time_from_ms=window.from_ms, time_to_ms=window.to_ms,
                        interval_ms=window.interval_ms, variables={MODEL_VARIABLE: model})  # fmt: skip
    frame = Frame.from_result(store.client.query(sql))
    return [dict(zip(frame.columns, row, strict=True)) for row in frame.rows]


def _rows(store: FleetStore, model: str) -> dict[str, np.ndarray]:
    mine = [c.latency for c in store.chunks if c.latency["model"][0] == model]
    return {k: np.concatenate([np.asarray(c[k]) for c in mine]) for k in ("consumer_id", "outcome", "reason", "e2e_ms")}


@pytest.mark.parametrize("model", ["minilm", "smollm"])
def test_grafana_panels_show_the_slow_consumer_and_the_refusals(fleet_clickhouse: FleetStore, model: str) -> None:
    store, rows = fleet_clickhouse, _rows(fleet_clickhouse, model)
    table = {r["consumer_id"]: r for r in _grafana(store, "By consumer", model)}
    assert set(table) == {f"{model}-c0", f"{model}-c1"}
    ran = rows["outcome"] != "rejected"
    for consumer, r in table.items():
        mine = ran & (rows["consumer_id"] == consumer)
        assert r["e2e_p99_ms"] == pytest.approx(np.quantile(rows["e2e_ms"][mine], 0.99), rel=1e-12)
    assert table[f"{model}-c1"]["e2e_p99_ms"] > 2 * table[f"{model}-c0"]["e2e_p99_ms"]
    series = _grafana(store, "e2e p99 by consumer", model)
    buckets: dict[Any, dict[str, float]] = {}
    for r in series:
        buckets.setdefault(r["time"], {})[r["consumer_id"]] = r["e2e_p99_ms"]
    both = [b for b in buckets.values() if len(b) == 2]
    slower = sum(b[f"{model}-c1"] > b[f"{model}-c0"] for b in both)
    assert len(both) >= 5 and slower >= 0.8 * len(both), f"c1 ({SLOW}x slower) above c0 in most buckets"
    not_ok = {r["cause"]: r for r in _grafana(store, "Not ok by outcome and reason", model)}
    for reason in ("too_long", "schema"):
        refused = (rows["outcome"] == "rejected") & (rows["reason"] == reason)
        assert not_ok[f"rejected: {reason}"]["share"] == pytest.approx(refused.mean(), rel=1e-12)
    assert any(cause.startswith("expired: ") for cause in not_ok)


def test_local_board_draws_the_fleet_panels(fleet_clickhouse: FleetStore) -> None:
    store = fleet_clickhouse
    page = build_page(store.client, _window(store), ["minilm"], board=FLEET)
    states = dict(re.findall(r'data-panel="([a-z0-9_]+)" data-state="([a-z]+)"', page))
    assert states == {p.key: "rendered" for p in FLEET.panels}
    section = page.split('data-panel="consumers"', 1)[1].split("</section>", 1)[0]
    slow = {r["consumer_id"]: r for r in _grafana(store, "By consumer", "minilm")}["minilm-c1"]
    assert "minilm-c1" in section and format_value(slow["e2e_p99_ms"], "ms") in section
    assert "model</th>" not in section, "the model column is hidden: one model per page"
    assert section.count('class="mark"') == 2, "one swatch per consumer"
