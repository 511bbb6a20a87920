"""Inline SVG charts for the local board: time series lines, grouped bars, and tables.

Server-side drawing keeps the page self-contained (no JavaScript library, no
CDN): the browser only has to paint SVG. Values are formatted with the same
units the Grafana panels declare, so both boards read alike.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from datetime import UTC, datetime

PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#fade2a", "#96d98d")
AXIS_COLOR = "#8e8e99"
GRID_COLOR = "#2c3235"
TEXT_COLOR = "#ccccdc"


@dataclass(frozen=True)
class Series:
    name: str
    unit: str
    points: tuple[tuple[float, float], ...]
    """(epoch ms, value) pairs, sorted by time."""


@dataclass(frozen=True)
class BarGroup:
    name: str
    values: tuple[float, ...]


def format_value(value: float, unit: str) -> str:
    """A value in the panel's unit, short enough for an axis label."""
    if unit == "ms":
        if abs(value) >= 1000:
            return f"{value / 1000:.3g} s"
        return f"{value:.3g} ms"
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "bytes":
        for suffix, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= size:
                return f"{value / size:.3g} {suffix}"
        return f"{value:.0f} B"
    suffix = {"reqps": " req/s", "tokens/s": " tok/s"}.get(unit, "")
    for letter, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{letter}{suffix}"
    return f"{value:.3g}{suffix}"


def _nice_max(value: float) -> float:
    if value <= 0 or not math.isfinite(value):
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(value))
    for step in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def _text(x: float, y: float, body: str, anchor: str = "start", size: int = 11, color: str = AXIS_COLOR) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" fill="{color}" font-size="{size}" '
        f'text-anchor="{anchor}">{html.escape(body)}</text>'
    )


def _legend(names: list[str], width: float, y: float) -> str:
    parts, x = [], 48.0
    for i, name in enumerate(names):
        label = name if len(name) <= 28 else name[:27] + "…"
        if x + 14 + 7 * len(label) > width and x > 48:
            break
        color = PALETTE[i % len(PALETTE)]
        parts.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="10" height="4" fill="{color}"/>')
        parts.append(_text(x + 14, y - 4, label, color=TEXT_COLOR))
        x += 26 + 7 * len(label)
    return "".join(parts)


def _time_label(ms: float, span_ms: float) -> str:
    moment = datetime.fromtimestamp(ms / 1000, tz=UTC)
    return moment.strftime("%H:%M:%S" if span_ms < 10 * 60_000 else "%H:%M")


def time_series_svg(
    series: list[Series],
    width: int,
    height: int,
    x_range: tuple[float, float],
    thresholds: list[tuple[float, str]],
    left_unit: str,
) -> str:
    """Lines over time: `left_unit` on the left axis, a second unit among the series on the right."""
    units = list(dict.fromkeys([left_unit] + [s.unit for s in series]))
    left, right, top, bottom = 64.0, (72.0 if len(units) > 1 else 14.0), 8.0, 40.0
    plot_w, plot_h = width - left - right, height - top - bottom
    scale_max = {}
    for unit in units:
        peak = max((v for s in series if s.unit == unit for _, v in s.points), default=0.0)
        if unit == units[0]:
            peak = max([peak] + [t for t, _ in thresholds if t <= peak * 1.5])
        scale_max[unit] = _nice_max(peak * 1.05)
        if unit == "percentunit" and peak <= 1.0:
            scale_max[unit] = min(scale_max[unit], 1.0)
    x0, x1 = x_range
    span = max(x1 - x0, 1.0)

    def sx(ms: float) -> float:
        return left + (ms - x0) / span * plot_w

    def sy(value: float, unit: str) -> float:
        return top + plot_h - max(0.0, value) / scale_max[unit] * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" class="chart">']
    for i in range(5):
        y = top + plot_h * i / 4
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w:.1f}" y2="{y:.1f}" stroke="{GRID_COLOR}"/>')
        for axis, unit in enumerate(units[:2]):
            label = format_value(scale_max[unit] * (4 - i) / 4, unit)
            x = left - 6 if axis == 0 else left + plot_w + 6
            out.append(_text(x, y + 4, label, anchor="end" if axis == 0 else "start"))
    for i in range(5):
        ms = x0 + span * i / 4
        anchor = "start" if i == 0 else "end" if i == 4 else "middle"
        out.append(_text(sx(ms), top + plot_h + 14, _time_label(ms, span), anchor=anchor))
    for value, color in thresholds:
        if units and value <= scale_max[units[0]]:
            y = sy(value, units[0])
            out.append(
                f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w:.1f}" y2="{y:.1f}" '
                f'stroke="{color}" stroke-dasharray="6 4" stroke-width="1"/>'
            )
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{sx(t):.1f},{sy(v, s.unit):.1f}" for t, v in s.points)
        if len(s.points) == 1:
            ((t, v),) = s.points
            out.append(f'<circle class="mark" cx="{sx(t):.1f}" cy="{sy(v, s.unit):.1f}" r="3" fill="{color}"/>')
        else:
            out.append(
                f'<polyline class="mark" points="{coords}" fill="none" stroke="{color}" '
                f'stroke-width="2" stroke-linejoin="round"/>'
            )
    out.append(_legend([s.name for s in series], width, height - 4))
    out.append("</svg>")
    return "".join(out)


def table_html(columns: list[str], rows: list[list[str]]) -> str:
    """An HTML table of formatted cells; each row starts with a swatch in the colour its series has
    in the board's time-series panels (rows and series come in the same order)."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for i, row in enumerate(rows):
        swatch = (
            f'<svg width="10" height="10" class="swatch"><rect class="mark" width="10" height="10" '
            f'fill="{PALETTE[i % len(PALETTE)]}"/></svg> '
        )
        cells = "".join(
            f'<td class="{"label" if j == 0 else "number"}">{swatch if j == 0 else ""}{html.escape(cell)}</td>'
            for j, cell in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    return f'<table class="values"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def bar_chart_svg(
    labels: list[str], groups: list[BarGroup], unit: str, width: int, height: int, max_value: float | None = None
) -> str:
    """Grouped vertical bars, one group of bars per label; `max_value` fixes the axis top."""
    left, right, top, bottom = 64.0, 12.0, 8.0, 40.0
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max((v for g in groups for v in g.values), default=0.0)
    scale = max_value if max_value is not None else _nice_max(peak * 1.05)
    slot = plot_w / max(len(labels), 1)
    bar_w = max(1.0, slot * 0.8 / max(len(groups), 1))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" class="chart">']
    for i in range(5):
        y = top + plot_h * i / 4
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w:.1f}" y2="{y:.1f}" stroke="{GRID_COLOR}"/>')
        out.append(_text(left - 6, y + 4, format_value(scale * (4 - i) / 4, unit), anchor="end"))
    widest = max((len(label) for label in labels), default=1)
    every = max(1, math.ceil(len(labels) * (6 * min(widest, 12) + 8) / plot_w))
    for i, label in enumerate(labels):
        x = left + slot * i + slot * 0.1
        for j, group in enumerate(groups):
            value = group.values[i] if i < len(group.values) else 0.0
            h = min(max(0.0, value) / scale, 1.0) * plot_h
            color = PALETTE[j % len(PALETTE)]
            out.append(
                f'<rect class="mark" x="{x + j * bar_w:.1f}" y="{top + plot_h - h:.1f}" width="{bar_w * 0.92:.1f}" '
                f'height="{h:.1f}" fill="{color}"><title>{html.escape(label)}: '
                f"{html.escape(format_value(value, unit))}</title></rect>"
            )
            if bar_w >= 30:  # room for the value, as Grafana's showValue "auto" does
                inside = h > plot_h - 14
                y = top + plot_h - h + (14 if inside else -4)
                out.append(
                    f'<text class="mark" x="{x + (j + 0.46) * bar_w:.1f}" y="{y:.1f}" '
                    f'fill="{"#111217" if inside else color}" font-size="11" '
                    f'text-anchor="middle">{html.escape(format_value(value, unit))}</text>'
                )
        if i % every == 0:
            room = max(12, int(slot / 6))
            short = label if len(label) <= room else label[: room - 1] + "…"
            out.append(_text(left + slot * (i + 0.5), top + plot_h + 14, short, anchor="middle", size=10))
    out.append(_legend([g.name for g in groups], width, height - 4))
    out.append("</svg>")
    return "".join(out)
