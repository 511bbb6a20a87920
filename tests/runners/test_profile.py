"""`batchtide profile` on tiny real models: the file it writes, and a consumer starting from it (not timed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from consumers.worker import build_consumer
from pipeline.cli import app
from pipeline.core import profile_file
from pipeline.core.config import load_config
from pipeline.core.engine.costcurve import CostCurve


def _profile(*args: str) -> tuple[str, dict]:
    result = CliRunner().invoke(app, ["profile", *args])
    assert result.exit_code == 0, result.output
    out = Path(args[args.index("--out") + 1])
    return result.output, json.loads(out.read_text())


@pytest.mark.model
def test_embedding_profile_doubles_sizes_and_recommends_a_cap(tiny_bert_dir: Path, tmp_path: Path) -> None:
    output, data = _profile(
        "--model",
        str(tiny_bert_dir),
        "--max-size",
        "8",
        "--tokens",
        "8",
        "--seconds",
        "0",
        "--out",
        str(tmp_path / "p.json"),
    )
    assert data["format"] == profile_file.FORMAT and data["task"] == "embed" and data["unit"] == "requests"
    assert [p["size"] for p in data["points"]] == [1, 2, 4, 8] and data["stop_reason"] == "max_size"
    for p in data["points"]:
        assert 0 < p["median_ms"] <= p["p90_ms"] and p["runs"] >= 3 and p["peak_bytes"] >= 0
        assert p["items_per_s"] == pytest.approx(p["size"] * 1000 / p["median_ms"])
    assert data["knee"] in (1, 2, 4, 8)
    assert data["memory"]["kind"] == "process_rss" and data["memory"]["limit_bytes"] > data["memory"]["base_bytes"]
    rec = data["recommended"]
    assert 1 <= rec["target_size"] <= rec["hard_cap"] <= 8
    assert [s for s, _ in data["cost_points"]] == [1, 2, 4, 8]
    assert "knee b=" in output and "recommended profile" in output and "real model" in output


@pytest.mark.model
def test_generation_profile_has_prefill_and_decode_curves_in_tokens(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    output, data = _profile(
        "--model",
        str(tiny_gpt2_dir),
        "--max-size",
        "4",
        "--tokens",
        "8",
        "--decode-steps",
        "4",
        "--out",
        str(tmp_path / "g.json"),
    )
    assert data["task"] == "generate" and data["unit"] == "tokens"
    assert [p["size"] for p in data["prefill"]] == [1, 2, 4] == [p["size"] for p in data["points"]]
    assert all(p["tokens_per_s"] == pytest.approx(p["size"] * 1000 / p["median_ms"]) for p in data["points"])
    per_request = data["prompt_tokens"] + 32  # the model's default max_new_tokens
    assert [s for s, _ in data["cost_points"]] == [b * per_request for b in (1, 2, 4)]
    assert data["recommended"]["batching"] == "iteration" and data["recommended"]["cost_unit"] == "tokens"
    # the cap holds the longest request the model admits: its 128 positions less max_new_tokens, plus those
    assert data["longest"]["prompt_tokens"] == 128 - 32 and data["recommended"]["hard_cap"] == 128
    assert data["recommended"]["target_size"] == per_request and data["longest"]["prefill"]["tokens"] == 96
    assert "longest admissible request: prompt 96 + max_new_tokens 32 = 128 tokens" in output
    assert "decode step" in output and "prefill" in output


@pytest.mark.model
def test_profile_stops_past_the_compute_budget(tiny_bert_dir: Path, tmp_path: Path) -> None:
    _, data = _profile(
        "--model",
        str(tiny_bert_dir),
        "--max-size",
        "64",
        "--budget-ms",
        "0.0001",
        "--seconds",
        "0",
        "--out",
        str(tmp_path / "b.json"),
    )
    assert data["stop_reason"] == "budget" and [p["size"] for p in data["points"]] == [1]


def test_profile_labels_simulated_runners(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[models.sim]\nrunner = "cost-model"\ncost_points = [[1, 2.0], [8, 4.0]]\n')
    output, data = _profile(
        "--config",
        str(config),
        "--model",
        "sim",
        "--max-size",
        "8",
        "--seconds",
        "0",
        "--out",
        str(tmp_path / "s.json"),
    )
    assert "SIMULATED" in output and data["simulated"] is True
    times = {p["size"]: p["median_ms"] for p in data["points"]}
    assert times[8] > times[1] >= 2.0  # the cost model sleeps its curve


@pytest.mark.model
def test_consumer_starts_from_its_profile_file(
    tiny_bert_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHTIDE_PROFILE_DIR", str(tmp_path / "profiles"))
    config = tmp_path / "c.toml"
    config.write_text(
        f'[models.tiny]\nmodel_path = "{tiny_bert_dir}"\ntorch_threads = 1\nisolation = "thread"\nhard_cap = 48\n'
    )
    _profile(
        "--config",
        str(config),
        "--model",
        "tiny",
        "--max-size",
        "4",
        "--seconds",
        "0",
        "--out",
        str(tmp_path / "profiles" / "tiny.json"),
    )
    consumer = build_consumer(load_config(config), "tiny")
    assert consumer.engine.ceiling <= 4  # held under what the profile measured
    curve = consumer.engine.curve
    assert isinstance(curve, CostCurve) and [s for s, _ in curve.points()] == [1, 2, 4]  # no cold probing
    # a profile measured for another set-up is ignored
    other = tmp_path / "other.toml"
    other.write_text(
        f'[models.tiny]\nmodel_path = "{tiny_bert_dir}"\ntorch_threads = 2\nisolation = "thread"\nhard_cap = 48\n'
    )
    fresh = build_consumer(load_config(other), "tiny")
    curve = fresh.engine.curve
    assert fresh.engine.ceiling == 48 and isinstance(curve, CostCurve) and curve.points() == []
