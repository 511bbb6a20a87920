"""Tables a person can read wherever they land: in a narrow terminal, piped into a file, every figure whole.

`print_table` prints a grid only when every cell fits whole, else one `column: value` block per row. The
CLI checks run `batchtide report` and `batchtide replay` as subprocesses with stdout a pipe and COLUMNS=80
(what `... > replay.txt` gets) and look for every figure of their JSON output in the text.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from pipeline.tools.views.report import _ms, _num, _pct
from pipeline.tools.views.tables import print_table

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 80


def _wide_table(rows: int = 3) -> tuple[Table, list[list[str]]]:
    table = Table(title="replay of minilm: 12,240 recorded requests over the last 1h")
    columns = ("candidate", "hard_cap", "target", "max_wait", "mark", "p50 ms", "p99 ms", "p999 ms",
               "req/s", "hit ratio", "expired", "marked", "mean batch")  # fmt: skip
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    cells = [[f"candidate number {r}", "128", "auto", "20", "1.5x q0.99", f"{38.8 + r:.1f}", f"{1_486.4 + r:,.1f}",
              f"{4_208.1 + r:,.1f}", "20.4", "0.13", "0.00%", "27.57%", "1.2"] for r in range(rows)]  # fmt: skip
    for row in cells:
        table.add_row(*row)
    return table, cells


def _printed(table: Table, width: int) -> str:
    out = io.StringIO()
    print_table(Console(file=out, width=width), table)
    return out.getvalue()


@pytest.mark.parametrize("width", [40, 60, 80, 120, 200])
def test_every_cell_is_printed_whole_at_any_width(width: int) -> None:
    table, cells = _wide_table()
    text = _printed(table, width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for row in cells:
        for cell in row:
            assert cell in text, (width, cell)


def test_a_table_that_does_not_fit_folds_into_key_value_blocks() -> None:
    table, _ = _wide_table()
    text = _printed(table, WIDTH)
    assert "┃" not in text, "too wide for 80 columns: blocks, not a grid"
    assert "  candidate number 0\n" in text
    assert "    p99 ms:     1,486.4\n" in text
    wide = _printed(_wide_table()[0], 200)
    assert "┃ candidate" in wide and "p99 ms:" not in wide, "a grid where it fits"


def test_a_narrow_table_stays_a_grid_at_80_columns() -> None:
    table = Table(title="Dispatch reasons")
    for column in ("model", "reason", "batches", "share"):
        table.add_column(column)
    table.add_row("minilm", "max_wait", "5,209", "69.03%")
    text = _printed(table, WIDTH)
    assert "┃ model" in text and "5,209" in text and "69.03%" in text


def _cli(config: Path, *args: str) -> str:
    """`batchtide ...` with stdout a pipe, as `... > file` runs it."""
    env = {**os.environ, "COLUMNS": str(WIDTH), "PYTHONPATH": str(ROOT), "TERM": "dumb"}
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args, "--config", str(config)],
        capture_output=True, text=True, env=env, cwd=config.parent, timeout=300,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chDB store of its own (the subprocesses open it; this process keeps its session engine elsewhere)."""
    work = tmp_path_factory.mktemp("piped")
    config = work / "batchtide.toml"
    config.write_text(f'[clickhouse]\ndata_dir = "{work / "chdb"}"\ndatabase = "batchtide"\n')
    _cli(config, "db", "seed", "--rows", "20000", "--duration", "10m", "--slow-consumer", "4", "--refused", "0.02")
    return config


def _assert_readable(text: str) -> None:
    assert "…" not in text, "a cell was cut"
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_piped_report_prints_every_figure_whole(store: Path) -> None:
    text = _cli(store, "report", "--since", "1h")
    body = json.loads(_cli(store, "report", "--since", "1h", "--json"))["sections"]
    _assert_readable(text)
    assert body["summary"] and body["consumers"] and body["not_ok_reasons"]
    for row in body["summary"]:
        for figure in (_num(row["requests"]), _num(row["requests_per_s"]), _num(row["e2e_p99_ms"]),
                       _num(row["e2e_p999_ms"]), _num(row["wait_p99_ms"]), _pct(row["not_ok_share"]),
                       _num(row["refused"])):  # fmt: skip
            assert figure in text, (row["model"], figure)
    for row in body["consumers"]:
        for figure in (row["consumer_id"], _num(row["requests"]), _pct(row["share"]), _ms(row["e2e_p99_ms"]),
                       _num(row["requests_per_s"]), _num(row["mean_batch_size"])):  # fmt: skip
            assert figure in text, (row["consumer_id"], figure)
    for row in body["not_ok_reasons"]:
        assert row["reason"] in text and _pct(row["share"]) in text


@pytest.mark.slow
def test_piped_replay_prints_every_candidate_whole(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    text = _cli(store, "replay", "--since", "1h", "--model", "minilm", "--validate", "--json", str(out))
    _assert_readable(text)
    body = json.loads(out.read_text())
    assert len(body["predictions"]) >= 3
    for p in body["predictions"]:
        assert p["name"] in text
        for figure in (p["p50_ms"], p["p99_ms"], p["p999_ms"], p["throughput_rps"], p["mean_batch"]):
            assert f"{figure:.1f}" in text, (p["name"], figure)
    recorded = body["recorded"]
    assert f"{recorded['p99_ms']:.1f}" in text and f"{recorded['throughput_rps']:.1f}" in text
