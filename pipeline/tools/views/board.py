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
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse

from dashboards.charts import bar_chart_svg, format_value, table_html, time_series_svg
from dashboards.panels import CONSUMER_LAG, FLEET, GENERATION, TAIL_LATENCY, BoardSpec, PanelSpec
from pipeline.tools.views.panel_data import (
    ClickHouseQuerier,
    PanelResult,
    TimeRange,
    fetch_panel,
    frame_bars,
    frame_series,
    frame_table,
    list_models,
    time_range,
)

COLUMN_PX = 64
ROW_PX = 34
PANEL_HEADER_PX = 30


def _stacked(top: BoardSpec, below: BoardSpec) -> BoardSpec:
    """One page holding `top`'s panels, then `below`'s under them on the same grid."""
    bottom = max(p.y + p.h for p in top.panels)
    moved = tuple(dataclasses.replace(p, y=p.y + bottom) for p in below.panels)
    return dataclasses.replace(top, title=f"{top.title} · {below.title.split(' — ')[-1]}", panels=top.panels + moved)


LOCAL_BOARD = _stacked(_stacked(_stacked(TAIL_LATENCY, CONSUMER_LAG), GENERATION), FLEET)
"""The local page: the tail-latency board, the consumer-lag panels below it, then the generation panels
(empty for a model that does not generate), then latency per consumer and the not-ok outcomes."""


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
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(board.title)}</title><style>{style}</style></head><body>"
        f'<div class="page"><h1>{html.escape(board.title)}</h1>'
        f'<p class="sub">{html.escape(window.describe())} · bucket {format_value(window.interval_ms, "ms")} · '
        f"same SQL as Grafana and <code>batchtide report</code></p><nav>{nav}</nav>"
        f"{''.join(body)}</div><script>{_PAINT_MARKER}</script></body></html>"
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
                    keep: dict[str, str] = {k: params[k] for k in ("since", "until") if k in params}
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
