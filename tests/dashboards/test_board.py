"""The local board: built from the seeded store, rendered by headless Chromium, every panel painted."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageStat
from typer.testing import CliRunner

from dashboards.panels import CONSUMER_LAG, GENERATION, TAIL_LATENCY, PanelSpec
from pipeline.tools.views.board import LOCAL_BOARD, build_page, make_server
from pipeline.tools.views.panel_data import TimeRange, time_range
from tests.dashboards.browser import dump_dom, screenshot
from tests.dashboards.cli import dashboards_cli
from tests.dashboards.conftest import SeededStore

GENERATING_MODEL, ENCODER_MODEL = "smollm", "minilm"
"""The seeded models (pipeline.core.store.seed.DEFAULT_MODELS): the second generates, the first embeds."""
LEGEND_PX = 46
"""Bottom strip of a panel holding the legend (coloured swatches even without data): not counted."""
PANEL_TAG = re.compile(r"<section\b[^>]*>")
ATTR = re.compile(r'data-([a-z]+)="([^"]*)"')


def _panel_attrs(page: str) -> dict[str, dict[str, str]]:
    panels = {}
    for tag in PANEL_TAG.findall(page):
        attrs = dict(ATTR.findall(tag))
        if "panel" in attrs:
            panels[attrs["panel"]] = attrs
    return panels


@pytest.fixture(scope="module")
def rendered(seeded_store: SeededStore, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """The page for the seeded generating model (every panel has data), as a file and as Chromium's screenshot."""
    work = tmp_path_factory.mktemp("board")
    page = work / "board.html"
    page.write_text(build_page(seeded_store.client, seeded_store.window, [GENERATING_MODEL]))
    png = screenshot(page, work / "profile", work / "board.png")
    yield page, png


def test_page_is_self_contained(rendered: tuple[Path, Path]) -> None:
    text = rendered[0].read_text()
    assert not re.search(r'(src|href)="(https?:)?//', text), "the page must not load anything"
    assert "<link" not in text and "@import" not in text


def test_every_panel_has_data_and_is_painted_by_the_browser(rendered: tuple[Path, Path], tmp_path: Path) -> None:
    page, _ = rendered
    dom = dump_dom(page, tmp_path / "profile")
    assert 'data-ready="true"' in dom, "the page script did not run"
    panels = _panel_attrs(dom)
    assert set(panels) == {p.key for p in LOCAL_BOARD.panels}
    assert {p.key for p in CONSUMER_LAG.panels} <= set(panels), "the lag panels are on the local board"
    for key, attrs in panels.items():
        assert attrs["state"] == "rendered", f"{key}: {attrs}"
        assert int(attrs["points"]) > 0, key
        assert attrs["painted"] == "true", f"{key} drew nothing visible"


def _coloured_pixels(image: Image.Image) -> int:
    """Pixels drawn in a series colour: axes, grid and labels are grey, the background near black."""
    colours = image.getcolors(maxcolors=1 << 20) or []
    return sum(n for n, colour in colours if isinstance(colour, tuple) and max(colour) - min(colour) > 60)


def test_screenshot_shows_something_inside_every_panel(rendered: tuple[Path, Path], tmp_path: Path) -> None:
    page, png = rendered
    panels = _panel_attrs(dump_dom(page, tmp_path / "profile"))
    image = Image.open(png).convert("RGB")
    for key, attrs in panels.items():
        x, y, w, h = (int(v) for v in attrs["rect"].split(","))
        assert x + w <= image.width and y + h <= image.height, f"{key} is outside the screenshot"
        plot = image.crop((x + 8, y + 32, x + w - 8, y + h - LEGEND_PX))
        assert _coloured_pixels(plot) >= 40, f"{key}: nothing drawn above the legend in the screenshot"
        assert max(ImageStat.Stat(plot).stddev) > 5, f"{key}: plot area is flat"
    blank = Image.new("RGB", (200, 100), (24, 27, 31))
    assert _coloured_pixels(blank) == 0


def test_empty_range_and_failing_panel_do_not_break_the_page(seeded_store: SeededStore) -> None:
    long_ago = TimeRange(86_400_000, 2 * 86_400_000)
    assert "No model has latency events" in build_page(seeded_store.client, long_ago)
    empty = _panel_attrs(build_page(seeded_store.client, long_ago, [seeded_store.models[0]]))
    assert {a["state"] for a in empty.values()} == {"empty"}
    encoder = _panel_attrs(build_page(seeded_store.client, seeded_store.window, [ENCODER_MODEL]))
    generation = {p.key for p in GENERATION.panels}
    assert {encoder[k]["state"] for k in generation} == {"empty"}, "a model that does not generate has no token timing"
    assert {a["state"] for k, a in encoder.items() if k not in generation} == {"rendered"}

    broken = PanelSpec(
        key="broken", title="Broken", kind="timeseries", query="no_such_query", fmt="time_series",
        unit="ms", description="a panel naming a query that does not exist", x=0, y=0, w=6, h=6,
    )  # fmt: skip
    board = type(TAIL_LATENCY)(**{**TAIL_LATENCY.__dict__, "panels": (broken, *TAIL_LATENCY.panels[1:])})
    page = build_page(seeded_store.client, seeded_store.window, [seeded_store.models[0]], board=board)
    states = {k: a["state"] for k, a in _panel_attrs(page).items()}
    assert states.pop("broken") == "error"
    assert set(states.values()) == {"rendered"}
    assert "no_such_query" in page


def test_served_board_answers_on_localhost(seeded_store: SeededStore) -> None:
    server = make_server(seeded_store.client, 0, "1h", None)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        model = seeded_store.models[-1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/?{seeded_store.url_params(model)}", timeout=30) as reply:
            page = reply.read().decode()
        assert reply.status == 200
        assert f"model: {model}" in page
        assert {a["state"] for a in _panel_attrs(page).values()} == {"rendered"}
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/?since=yesterday-ish", timeout=30)
        assert bad.value.code == 400
    finally:
        server.shutdown()
        server.server_close()


def test_time_range_parsing() -> None:
    now = 1_800_000_000_000
    assert time_range("15m", now_ms=now) == TimeRange(now - 900_000, now)
    assert time_range("2h", "30m", now_ms=now) == TimeRange(now - 7_200_000, now - 1_800_000)
    iso = time_range("2026-01-01T00:00", "2026-01-01T01:00:00+00:00", now_ms=now)
    assert (iso.from_ms, iso.to_ms) == (1_767_225_600_000, 1_767_229_200_000)
    assert iso.interval_ms == 30_000
    with pytest.raises(ValueError):
        time_range("5m", "10m", now_ms=now)
    with pytest.raises(ValueError):
        time_range("soon", now_ms=now)


def test_board_command_writes_the_page(seeded_clickhouse: Any, seeded_store: SeededStore, tmp_path: Path) -> None:
    config = tmp_path / "batchtide.toml"
    settings = seeded_clickhouse.settings
    config.write_text(f'[clickhouse]\ndata_dir = "{settings.data_dir}"\ndatabase = "{settings.database}"\n')
    out = tmp_path / "out" / "board.html"
    args = ["board", "--out", str(out), "--config", str(config), "--model", GENERATING_MODEL]
    args += ["--since", seeded_store.since, "--until", seeded_store.until]
    result = CliRunner().invoke(dashboards_cli(), args)
    assert result.exit_code == 0, result.output
    states = {a["state"] for a in _panel_attrs(out.read_text()).values()}
    assert states == {"rendered"}
    both = CliRunner().invoke(dashboards_cli(), ["board", "--out", str(out), "--serve", "8999"])
    assert both.exit_code == 2 and "exactly one" in both.output
