"""The profile command's report: a row per point and a pasteable cost_points line (not timed)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from consumers.runners.profile import main


def test_profile_prints_pasteable_cost_points(tiny_bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "points.json"
    main(["--model", str(tiny_bert_dir), "--batch-sizes", "4,1", "--tokens", "8", "--seconds", "0", "--json", str(out_json)])
    report = capsys.readouterr().out
    assert "real model" in report and "load average" in report
    line = next(l for l in report.splitlines() if l.startswith("cost_points"))
    points = tomllib.loads(line)["cost_points"]
    assert [b for b, _ in points] == [1, 4] and all(ms > 0 for _, ms in points)
    saved = json.loads(out_json.read_text())
    assert [p["batch"] for p in saved] == [1, 4] and all(p["runs"] >= 3 for p in saved)


def test_profile_labels_simulated_runners(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[models.sim]\nrunner = "cost-model"\ncost_points = [[1, 2.0], [8, 4.0]]\n')
    main(["--config", str(config), "--model", "sim", "--batch-sizes", "1,8", "--seconds", "0"])
    report = capsys.readouterr().out
    assert "SIMULATED" in report
    assert re.search(r"^cost_points = \[\[1, \d+\.\d\], \[8, \d+\.\d\]\]$", report, re.M)
