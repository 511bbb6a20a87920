"""What a board panel shows, as data: the time range, the panel's SQL as the Grafana
ClickHouse plugin would send it, and the result shaped the way the plugin shapes it
(series, bars or a table). The local board (`board.py`) draws these; tests check them.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Protocol

from dashboards.charts import BarGroup, Series, format_value
from dashboards.panels import MODEL_VARIABLE, MODELS_QUERY, PanelSpec
from dashboards.sql import query_sql
from pipeline.tools.views.report import DURATION, parse_duration_ms

MAX_DATA_POINTS = 120
NICE_INTERVALS_MS = (
    1_000,
    2_000,
    5_000,
    10_000,
    15_000,
    30_000,
    60_000,
    120_000,
    300_000,
    600_000,
    900_000,
    1_800_000,
    3_600_000,
    7_200_000,
    21_600_000,
    43_200_000,
    86_400_000,
)


class ClickHouseQuerier(Protocol):
    """What the board needs from a clickhouse-connect client (chDB or HTTP)."""

    def query(self, query: str) -> Any: ...


@dataclass(frozen=True)
class TimeRange:
    from_ms: int
    to_ms: int

    @property
    def interval_ms(self) -> int:
        """Bucket width like Grafana's $__interval: range / max data points, rounded up to a nice step."""
        raw = (self.to_ms - self.from_ms) / MAX_DATA_POINTS
        return next((step for step in NICE_INTERVALS_MS if step >= raw), NICE_INTERVALS_MS[-1])

    def describe(self) -> str:
        def fmt(ms: int) -> str:
            return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

        return f"{fmt(self.from_ms)} → {fmt(self.to_ms)}"


def parse_instant(text: str, now_ms: int) -> int:
    """`15m`/`2h` back from now, or an ISO-8601 time (UTC when no zone is given)."""
    text = text.strip()
    if DURATION.match(text):
        return now_ms - parse_duration_ms(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration like 15m/1h/2d nor an ISO time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def time_range(since: str, until: str | None = None, now_ms: int | None = None) -> TimeRange:
    now = int(time.time() * 1000) if now_ms is None else now_ms
    end = parse_instant(until, now) if until else now
    start = parse_instant(since, now)
    if start >= end:
        raise ValueError(f"empty time range: --since {since!r} is not before --until {until!r}")
    return TimeRange(start, end)


@dataclass(frozen=True)
class Frame:
    """A query result: column names, ClickHouse type names, rows."""

    columns: list[str]
    types: list[str]
    rows: list[Sequence[Any]]

    @classmethod
    def from_result(cls, result: Any) -> Frame:
        types = [getattr(t, "name", str(t)) for t in result.column_types]
        return cls(list(result.column_names), types, [tuple(r) for r in result.result_rows])

    def kind(self, index: int) -> str:
        """`time`, `number` or `label` — how a Grafana panel would treat the column."""
        name = self.types[index]
        while m := re.fullmatch(r"(?:Nullable|LowCardinality)\((.*)\)", name):
            name = m.group(1)
        if name.startswith(("DateTime", "Date")):
            return "time"
        if name.startswith(("Int", "UInt", "Float", "Decimal")):
            return "number"
        return "label"


@dataclass(frozen=True)
class PanelResult:
    spec: PanelSpec
    frame: Frame | None
    error: str | None = None


def _epoch_ms(value: Any) -> float:
    if isinstance(value, datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=UTC)
        return moment.timestamp() * 1000
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=UTC).timestamp() * 1000
    return float(value)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def frame_series(frame: Frame, spec: PanelSpec) -> list[Series]:
    """Wide or long (label column) time-series frames into named series, like the plugin does.

    Label values shared by every row (the one selected model) are left out of the names.
    """
    if not frame.rows:
        return []
    kinds = [frame.kind(i) for i in range(len(frame.columns))]
    if "time" not in kinds:
        raise ValueError(f"a time series panel needs a time column; got {frame.columns} {frame.types}")
    time_index = kinds.index("time")
    labels = [i for i, k in enumerate(kinds) if k == "label" and len({row[i] for row in frame.rows}) > 1]
    numbers = [i for i, k in enumerate(kinds) if k == "number" and frame.columns[i] not in spec.hidden]
    points: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for row in frame.rows:
        label = " ".join(str(row[i]) for i in labels)
        for i in numbers:
            value = _number(row[i])
            if value is None:
                continue
            column = frame.columns[i]
            name = column if not label else (label if len(numbers) == 1 else f"{label} {column}")
            points.setdefault((name, column), []).append((_epoch_ms(row[time_index]), value))
    return [
        Series(name, spec.field_units.get(column, spec.unit), tuple(sorted(pts)))
        for (name, column), pts in points.items()
    ]


def frame_bars(frame: Frame, spec: PanelSpec) -> tuple[list[str], list[BarGroup]]:
    """A table frame as x labels (x_field, else the first non-numeric column) and value groups."""
    if not frame.rows:
        return [], []
    kinds = [frame.kind(i) for i in range(len(frame.columns))]
    if spec.x_field:
        x_index = frame.columns.index(spec.x_field)
    else:
        x_index = next((i for i, k in enumerate(kinds) if k != "number"), 0)
    value_indexes = [
        i for i, k in enumerate(kinds) if k == "number" and i != x_index and frame.columns[i] not in spec.hidden
    ]
    labels = [_x_label(row[x_index]) for row in frame.rows]
    groups = [BarGroup(frame.columns[i], tuple(_number(row[i]) or 0.0 for row in frame.rows)) for i in value_indexes]
    return labels, groups


def frame_table(frame: Frame, spec: PanelSpec) -> tuple[list[str], list[list[str]]]:
    """A table frame as header and formatted cells, hidden columns left out, numbers in their unit."""
    shown = [i for i, name in enumerate(frame.columns) if name not in spec.hidden]
    rows = []
    for row in frame.rows:
        cells = []
        for i in shown:
            value = row[i]
            if frame.kind(i) == "number":
                number, unit = _number(value), spec.field_units.get(frame.columns[i], spec.unit)
                cells.append("-" if number is None else format_value(number, unit))
            else:
                cells.append(_x_label(value))
        rows.append(cells)
    return [frame.columns[i] for i in shown], rows


def _x_label(value: Any) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    return str(value)


def expand(sql: str, window: TimeRange, model: str | None) -> str:
    """Panel SQL as the ClickHouse plugin would send it for this range and model."""
    from pipeline.core.store.macros import expand_macros

    return expand_macros(
        sql,
        time_from_ms=window.from_ms,
        time_to_ms=window.to_ms,
        interval_ms=window.interval_ms,
        variables={MODEL_VARIABLE: model or ""},
    )


def list_models(client: ClickHouseQuerier, window: TimeRange) -> list[str]:
    frame = Frame.from_result(client.query(expand(query_sql(MODELS_QUERY), window, None)))
    return [str(row[0]) for row in frame.rows]


def fetch_panel(client: ClickHouseQuerier, spec: PanelSpec, window: TimeRange, model: str) -> PanelResult:
    """Run one panel's query; a failing panel shows its error instead of sinking the page."""
    try:
        frame = Frame.from_result(client.query(expand(query_sql(spec.query), window, model)))
    except Exception as error:
        return PanelResult(spec, None, f"{type(error).__name__}: {error}")
    return PanelResult(spec, frame)
