"""The local tail-latency board: the Grafana panels as one self-contained HTML page.

For machines without Grafana. Every panel of `dashboards/panels.py` is computed
from the same named query Grafana runs, with the plugin's macros expanded by
`pipeline.core.store.macros.expand_macros`, against the embedded or configured
ClickHouse. The consumer-lag panels (`CONSUMER_LAG`) sit below the tail-latency ones, the
generation panels (`GENERATION`) below those, and the per-consumer and outcome panels (`FLEET`) last. The page holds inline SVG and a few lines of inline script that
mark each panel painted; nothing is fetched from anywhere.
"""

from __future__ import annotations

import dataclasses
import html
import math
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlencode, urlparse

from dashboards.charts import BarGroup, Series, bar_chart_svg, format_value, table_html, time_series_svg
from dashboards.panels import (
    CONSUMER_LAG,
    FLEET,
    GENERATION,
    MODEL_VARIABLE,
    MODELS_QUERY,
    TAIL_LATENCY,
    BoardSpec,
    PanelSpec,
)
from dashboards.sql import query_sql
from pipeline.views.report import DURATION, parse_duration_ms

COLUMN_PX = 64
ROW_PX = 34
PANEL_HEADER_PX = 30
MAX_DATA_POINTS = 120
NICE_INTERVALS_MS = (
    1_000, 2_000, 5_000, 10_000, 15_000, 30_000, 60_000, 120_000, 300_000, 600_000,
    900_000, 1_800_000, 3_600_000, 7_200_000, 21_600_000, 43_200_000, 86_400_000,
)


def _stacked(top: BoardSpec, below: BoardSpec) -> BoardSpec:
    """One page holding `top`'s panels, then `below`'s under them on the same grid."""
    bottom = max(p.y + p.h for p in top.panels)
    moved = tuple(dataclasses.replace(p, y=p.y + bottom) for p in below.panels)
    return dataclasses.replace(top, title=f"{top.title} · {below.title.split(' — ')[-1]}", panels=top.panels + moved)


LOCAL_BOARD = _stacked(_stacked(_stacked(TAIL_LATENCY, CONSUMER_LAG), GENERATION), FLEET)
"""The local page: the tail-latency board, the consumer-lag panels below it, then the generation panels
(empty for a model that does not generate), then latency per consumer and the not-ok outcomes."""


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
            return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

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
        moment = moment.replace(tzinfo=timezone.utc)
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
    def from_result(cls, result: Any) -> "Frame":
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
        moment = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        return moment.timestamp() * 1000
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=timezone.utc).timestamp() * 1000
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
    groups = [
        BarGroup(frame.columns[i], tuple(_number(row[i]) or 0.0 for row in frame.rows)) for i in value_indexes
    ]
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
    except Exception as error:  # noqa: BLE001 - any driver error is shown in its panel
        return PanelResult(spec, None, f"{type(error).__name__}: {error}")
    return PanelResult(spec, frame)


def _panel_size(spec: PanelSpec) -> tuple[int, int]:
    return spec.w * COLUMN_PX - 26, spec.h * ROW_PX - PANEL_HEADER_PX - 26


def _panel_body(result: PanelResult, window: TimeRange) -> tuple[str, str, int]:
    """(state, inner HTML, data points) for one panel."""
    if result.error is not None:
        return "error", f'<div class="message error">{html.escape(result.error)}</div>', 0
    assert result.frame is not None
    width, height = _panel_size(result.spec)
    spec = result.spec
    if spec.kind == "timeseries":
        series = frame_series(result.frame, spec)
        count = sum(len(s.points) for s in series)
        thresholds = [(t.value, t.color) for t in spec.thresholds]
        svg = time_series_svg(series, width, height, (window.from_ms, window.to_ms), thresholds, spec.unit)
    elif spec.kind == "table":
        columns, rows = frame_table(result.frame, spec)
        count = len(rows) * len(columns)
        svg = table_html(columns, rows)
    else:
        labels, groups = frame_bars(result.frame, spec)
        count = len(labels) * len(groups)
        svg = bar_chart_svg(labels, groups, spec.unit, width, height, spec.max_value)
    if count == 0:
        return "empty", '<div class="message">No data in this time range</div>', 0
    return "rendered", svg, count


def _panel_html(result: PanelResult, window: TimeRange) -> str:
    spec = result.spec
    try:
        state, body, count = _panel_body(result, window)
    except ValueError as error:
        state, body, count = "error", f'<div class="message error">{html.escape(str(error))}</div>', 0
    style = f"grid-column:{spec.x + 1} / span {spec.w};grid-row:{spec.y + 1} / span {spec.h}"
    return (
        f'<section class="panel" data-panel="{spec.key}" data-state="{state}" data-points="{count}" '
        f'style="{style}"><header><h2>{html.escape(spec.title)}</h2>'
        f'<span class="unit">{html.escape(spec.unit)}</span>'
        f'<span class="help" title="{html.escape(spec.description)}">?</span></header>'
        f'<div class="body">{body}</div></section>'
    )


_STYLE = """
body{margin:0;background:#111217;color:#ccccdc;font:13px/1.35 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif}
.page{width:%(width)dpx;padding:12px 16px}
h1{font-size:20px;margin:0 0 2px;color:#fff} .sub{color:#8e8e99;margin:0 0 10px}
nav a{color:#6e9fff;margin-right:12px} h3.model{font-size:16px;margin:16px 0 6px;color:#fff}
.grid{display:grid;grid-template-columns:repeat(24,%(col)dpx);grid-auto-rows:%(row)dpx}
.panel{margin:4px;background:#181b1f;border:1px solid #2c3235;border-radius:3px;overflow:hidden;position:relative}
.panel header{display:flex;align-items:center;gap:8px;height:%(head)dpx;padding:0 10px}
.panel h2{font-size:13px;font-weight:500;margin:0;color:#ccccdc;flex:1}
.unit{color:#8e8e99;font-size:11px} .help{color:#8e8e99;cursor:help;border:1px solid #44474f;border-radius:50%%;
width:14px;height:14px;font-size:10px;text-align:center;line-height:14px}
.body{padding:0 8px} table.values{border-collapse:collapse;width:100%%}
table.values th{color:#8e8e99;font-weight:500;text-align:right;padding:2px 6px;border-bottom:1px solid #2c3235}
table.values th:first-child,td.label{text-align:left} td.number{text-align:right;font-variant-numeric:tabular-nums}
table.values td{padding:2px 6px;border-bottom:1px solid #22252b} .swatch{vertical-align:middle}
.message{color:#8e8e99;padding:24px 8px;text-align:center} .error{color:#f2495c;text-align:left;
font-family:monospace;font-size:11px;white-space:pre-wrap}
"""

_PAINT_MARKER = """
for (const panel of document.querySelectorAll('section.panel')) {
  let area = 0;
  for (const mark of panel.querySelectorAll('.mark')) {
    const box = mark.getBBox();
    const line = mark.tagName === 'polyline' || mark.tagName === 'circle';
    area += box.width * Math.max(box.height, line ? 1 : 0);
  }
  panel.dataset.painted = area > 0 ? 'true' : 'false';
  const r = panel.getBoundingClientRect();
  panel.dataset.rect = [r.left + scrollX, r.top + scrollY, r.width, r.height].map(Math.round).join(',');
}
document.body.dataset.ready = 'true';
"""


def render_page(
    board: BoardSpec,
    sections: list[tuple[str, list[PanelResult]]],
    window: TimeRange,
    links: dict[str, str] | None = None,
) -> str:
    """The whole page: one grid of panels per model, in the Grafana layout."""
    width = 24 * COLUMN_PX
    style = _STYLE % {"width": width, "col": COLUMN_PX, "row": ROW_PX, "head": PANEL_HEADER_PX}
    nav_links = links or {model: f"#model-{model}" for model, _ in sections}
    nav = " ".join(f'<a href="{html.escape(href)}">{html.escape(m)}</a>' for m, href in nav_links.items())
    body = []
    for model, results in sections:
        panels = "".join(_panel_html(r, window) for r in results)
        body.append(
            f'<h3 class="model" id="model-{html.escape(model)}">model: {html.escape(model)}</h3>'
            f'<div class="grid">{panels}</div>'
        )
    if not sections:
        body.append('<p class="message">No model has latency events in this time range.</p>')
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(board.title)}</title><style>{style}</style></head><body>"
        f'<div class="page"><h1>{html.escape(board.title)}</h1>'
        f'<p class="sub">{html.escape(window.describe())} · bucket {format_value(window.interval_ms, "ms")} · '
        f"same SQL as Grafana and <code>batchtide report</code></p><nav>{nav}</nav>"
        f'{"".join(body)}</div><script>{_PAINT_MARKER}</script></body></html>'
    )


def build_page(
    client: ClickHouseQuerier,
    window: TimeRange,
    models: list[str] | None = None,
    board: BoardSpec = LOCAL_BOARD,
    links: dict[str, str] | None = None,
) -> str:
    """Query every panel for each model (all models seen in the range when none given)."""
    chosen = models or list_models(client, window)
    sections = [(m, [fetch_panel(client, spec, window, m) for spec in board.panels]) for m in chosen]
    return render_page(board, sections, window, links)


def make_server(
    client: ClickHouseQuerier, port: int, since: str, model: str | None, host: str = "127.0.0.1"
) -> ThreadingHTTPServer:
    """An HTTP server for the board; every page load re-runs the queries.

    `?since=15m&until=...&model=NAME` in the URL override the command-line defaults.
    Queries run one at a time: an embedded chDB client is not shared across threads.
    """
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path not in ("/", "/index.html"):
                self.send_error(404)
                return
            params = {k: v[-1] for k, v in parse_qs(url.query).items()}
            status = 200
            try:
                window = time_range(params.get("since", since), params.get("until"))
                with lock:
                    everyone = list_models(client, window)
                    chosen = [params["model"]] if params.get("model") else ([model] if model else everyone[:1])
                    keep = {k: params[k] for k in ("since", "until") if k in params}
                    links = {m: "/?" + urlencode({**keep, "model": m}) for m in everyone}
                    page = build_page(client, window, chosen, links=links)
            except ValueError as error:
                status, page = 400, f"<!doctype html><p>{html.escape(str(error))}</p>"
            data = page.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return ThreadingHTTPServer((host, port), Handler)


def serve(client: ClickHouseQuerier, port: int, since: str, model: str | None) -> None:
    server = make_server(client, port, since, model)
    try:
        server.serve_forever()
    finally:
        server.server_close()
