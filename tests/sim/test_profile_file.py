"""The device profile file: loading, clear errors, and its use as a scenario's [cost]."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core import profile_file
from pipeline.core.config import ModelConfig
from pipeline.core.profile_file import CostPoint, DeviceProfile, ProfileError, load_profile
from pipeline.core.sim.scenario_file import load_scenario, with_cost

ROOT = Path(__file__).resolve().parents[2]


def _profile() -> DeviceProfile:
    return DeviceProfile(
        model="minilm",
        device="cpu",
        unit="requests",
        memory_limit=64,
        points=(CostPoint(1, 17.0, 19.0, 1_000_000), CostPoint(8, 94.0), CostPoint(64, 900.0)),
        knee=8,
        stopped_because="budget",
    )


def test_round_trip_and_what_the_engine_and_simulator_get(tmp_path: Path) -> None:
    path = tmp_path / "minilm.profile.json"
    _profile().write(path)
    loaded = load_profile(path)
    assert loaded == _profile()
    assert loaded.memory_limit == 64 and loaded.cost_points() == [(1, 17.0), (8, 94.0), (64, 900.0)]
    cost = with_cost(load_scenario(ROOT / "scenarios" / "demo.toml"), loaded.scenario_cost(), str(path)).cost
    assert cost.max_batch == 64
    assert cost.batch_ms(8, 0, 0.0) == 94.0 and cost.batch_ms(64, 0, 0.0) == 900.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "v0"}, "format: expected 'batchtide-profile/1'"),
        ({"unit": "bytes"}, "unit: 'bytes' is not one of"),
        ({"memory_limit": 0}, "memory_limit: must be > 0"),
        ({"points": []}, "points: expected a non-empty list"),
        ({"points": [{"size": 8, "median_ms": 5}, {"size": 4, "median_ms": 3}]}, "increasing and distinct"),
        ({"points": [{"size": 1.5, "median_ms": 5}]}, "points[0].size: expected a whole number"),
        ({"extra": 1}, "unknown key 'extra'"),
    ],
)
def test_bad_files_name_the_file_and_key(tmp_path: Path, change: dict, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**_profile().to_json(), **change}))
    with pytest.raises(ProfileError) as error:
        load_profile(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_bench_policies_runs_on_a_profile_and_rejects_a_broken_one(tmp_path: Path) -> None:
    path = tmp_path / "minilm.profile.json"
    _profile().write(path)
    scenario = tmp_path / "s.toml"
    scenario.write_text(
        'name = "tiny"\nslo_p99_ms = 1000.0\n[[phases]]\nduration_s = 2\nrate_per_s = 40\n'
        "[cost]\na_ms = 1.0\nc_ms = 0.1\n"
    )
    runner = CliRunner()
    out = tmp_path / "r.json"
    result = runner.invoke(
        app, ["bench", "policies", "-s", str(scenario), "--profile", str(path), "--quick", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["physical_limit_rps"] == pytest.approx(1000.0 * 8 / 94.0, rel=1e-6)
    path.write_text("{")
    broken = runner.invoke(app, ["bench", "policies", "-s", str(scenario), "--profile", str(path)])
    assert broken.exit_code == 2 and "not valid JSON" in broken.output


@pytest.mark.parametrize("content", ["[]", "null", "3"])
def test_a_profile_that_is_not_a_json_object_is_ignored_at_start(tmp_path: Path, content: str) -> None:
    """A consumer starts without it (logged), as for any other unreadable profile; it does not crash."""
    path = tmp_path / "m.json"
    path.write_text(content)
    assert profile_file.apply(ModelConfig(name="m", runner="zero-cost"), path) == {}
    with pytest.raises(ValueError, match="not a"):
        profile_file.read(path)
