"""Every Grafana panel's SQL, macros expanded as the plugin does, runs on seeded rows in chDB
and returns the shape its panel type needs."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from dashboards.panels import CONSUMER_LAG, FLEET, GENERATION, MODEL_VARIABLE, TAIL_LATENCY
from pipeline.core.store.macros import expand_macros
from pipeline.tools.views.panel_data import Frame, TimeRange
from tests.dashboards.conftest import SeededStore

BOARD_FILE = Path(__file__).resolve().parents[2] / "dashboards" / f"{TAIL_LATENCY.uid}.json"
LEFTOVER = re.compile(r"\$__\w+|\$\{\w+\}|\$" + MODEL_VARIABLE + r"\b")


def _committed_board() -> dict[str, Any]:
    return json.loads(BOARD_FILE.read_text())


def _run(store: SeededStore, sql: str, model: str) -> Frame:
    window: TimeRange = store.window
    expanded = expand_macros(
        sql,
        time_from_ms=window.from_ms,
        time_to_ms=window.to_ms,
        interval_ms=window.interval_ms,
        variables={MODEL_VARIABLE: model},
    )
    assert not LEFTOVER.search(expanded), f"unexpanded macro or variable left in: {expanded}"
    return Frame.from_result(store.client.query(expanded))


def _panels() -> list[dict[str, Any]]:
    lag_board = json.loads((BOARD_FILE.parent / f"{CONSUMER_LAG.uid}.json").read_text())
    fleet_board = json.loads((BOARD_FILE.parent / f"{FLEET.uid}.json").read_text())
    return _committed_board()["panels"] + lag_board["panels"] + _generation_panels() + fleet_board["panels"]


def _generation_panels() -> list[dict[str, Any]]:
    return json.loads((BOARD_FILE.parent / f"{GENERATION.uid}.json").read_text())["panels"]


def _generates(store: SeededStore, model: str) -> bool:
    return bool(store.client.command(
        "SELECT count() FROM request_latency WHERE model = {m:String} AND toUnixTimestamp64Milli(first_token_time) > 0",
        parameters={"m": model},
    ))  # fmt: skip


def test_model_variable_query_lists_the_seeded_models(seeded_store: SeededStore) -> None:
    (variable,) = _committed_board()["templating"]["list"]
    frame = _run(seeded_store, variable["query"], "")
    assert len(frame.columns) == 1 and frame.kind(0) == "label"
    assert sorted(str(r[0]) for r in frame.rows) == sorted(seeded_store.models)


@pytest.mark.parametrize("panel", _panels(), ids=lambda p: p["title"])
def test_panel_sql_returns_the_shape_its_panel_needs(seeded_store: SeededStore, panel: dict[str, Any]) -> None:
    (target,) = panel["targets"]
    generation_only = panel["title"] in {p["title"] for p in _generation_panels()}
    generating = [m for m in seeded_store.models if _generates(seeded_store, m)]
    assert generating, "the seed must hold a generating model"
    for model in seeded_store.models:
        frame = _run(seeded_store, target["rawSql"], model)
        if generation_only and model not in generating:
            assert not frame.rows, f"{panel['title']}: {model} generates nothing, its panel must stay empty"
            continue
        kinds = [frame.kind(i) for i in range(len(frame.columns))]
        assert frame.rows, f"{panel['title']} returned no rows for {model}"
        if panel["type"] == "timeseries":
            assert target["format"] == 0
            assert kinds.count("time") == 1, f"need exactly one time column, got {frame.types}"
            assert "number" in kinds, f"need a numeric column, got {frame.types}"
            times = [r[kinds.index("time")] for r in frame.rows]
            assert times == sorted(times), "time series rows must come ordered by time"
            assert all(
                seeded_store.window.from_ms - seeded_store.window.interval_ms
                <= r[kinds.index("time")].timestamp() * 1000
                <= seeded_store.window.to_ms
                for r in frame.rows
            ), "buckets outside the dashboard time range"
        else:
            assert target["format"] == 1
            x_field = panel["options"].get("xField")
            x_index = (
                frame.columns.index(x_field) if x_field else next((i for i, k in enumerate(kinds) if k != "number"), 0)
            )
            values = [i for i, k in enumerate(kinds) if k == "number" and i != x_index]
            assert values, f"a bar chart needs a numeric column beside x, got {frame.columns} {frame.types}"
            assert len({r[x_index] for r in frame.rows}) == len(frame.rows), "x values must be unique"
        numbers = [r[i] for r in frame.rows for i, k in enumerate(kinds) if k == "number"]
        assert all(v is None or math.isnan(v) or v >= 0 for v in numbers), "negative values on a panel with min 0"
