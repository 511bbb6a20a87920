"""`bench generation --trace`: a trace's slice through batchtide's loop and the peers' schedulers,
the device and objectives it picks, the time scale it searches, and the configured-model row."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.config import BatchProfile, ModelConfig
from pipeline.core.profile_file import DeviceProfile, GenerationCurves
from pipeline.core.sim.generation.trace import TraceSlice, read_trace, write_trace
from pipeline.tools.bench.generation_trace import (
    ATTAINMENT,
    DEFAULT_CURVE,
    TraceDevice,
    bench_trace,
    default_objectives,
    find_device,
    search_time_scale,
)


def bursty_trace(path: Path, n: int = 120, seed: int = 5) -> Path:
    """Bursts of requests a few seconds apart, prompts and answers spread as a production trace's."""
    rng = np.random.default_rng(seed)
    bursts = np.sort(rng.uniform(0, 60, size=n // 10))
    offsets = np.sort(np.concatenate([b + rng.exponential(0.2, size=10) for b in bursts]))
    prompts = np.clip(rng.lognormal(np.log(600), 1.0, size=n), 5, 4000).astype(int)
    answers = np.clip(rng.lognormal(np.log(20), 0.9, size=n), 1, 300).astype(int)
    return write_trace(path, offsets, prompts, answers)


DEVICE = TraceDevice(DEFAULT_CURVE, 60_000, "test curve")


def test_objectives_come_from_the_device_and_the_slice(tmp_path: Path) -> None:
    sliced = TraceSlice().apply(read_trace(bursty_trace(tmp_path / "t.csv")))
    ttft, tpot = default_objectives(DEFAULT_CURVE, sliced)
    p90 = int(np.percentile(sliced.prompt, 90))
    assert ttft == pytest.approx(5 * (10.0 + 0.12 * p90))
    assert 5 * 20.15 <= tpot <= 5 * 20.2  # a lone step at the median cache


def test_the_search_finds_a_scale_where_the_best_peer_meets_the_objectives_for_most(tmp_path: Path) -> None:
    trace = read_trace(bursty_trace(tmp_path / "t.csv"))
    found = search_time_scale(trace, TraceSlice(), DEVICE, lambda s: default_objectives(DEFAULT_CURVE, s))
    low, high = ATTAINMENT
    assert low <= found.attained <= high, found.tried
    heavier = [a for s, a in found.tried if s < found.scale]
    assert all(a <= found.attained + 0.02 for a in heavier), "a heavier load meets no more"


def test_the_report_sets_batchtide_beside_every_peer_and_the_configured_model(tmp_path: Path) -> None:
    path = bursty_trace(tmp_path / "t.csv")
    curves = GenerationCurves(prefill=((32, 13.8), (512, 71.4), (4096, 501.5)), steps=((1, 64, 20.15), (64, 64, 29.6)))
    profile = DeviceProfile("gen", "cpu", "tokens", 8000, (), generation=curves)
    device = TraceDevice(DEFAULT_CURVE, 60_000, "test", profile)
    model = ModelConfig(
        name="gen",
        task="generate",
        batching="iteration",
        max_input_tokens=4000,
        max_new_tokens=300,
        profile=BatchProfile(cost_unit="tokens", hard_cap=4300, target_size=332, max_inflight_batches=12),
    )
    report = bench_trace(path, TraceSlice(time_scale=3.0, start_s=10, duration_s=30), device, 2000.0, 150.0,
                         quick=True, search=False, model=model)  # fmt: skip
    systems = [r["system"] for r in report["rows"]]
    assert systems[0] == "batchtide-default" and systems[-1] == "batchtide (gen as configured)"
    assert {"vllm (oracle)", "tgi (oracle)", "sglang (oracle)", "fixed-window (oracle)"} <= set(systems)
    assert report["time_scale"] == 3.0 and not report["time_scale_searched"]
    assert (report["ttft_ms"], report["tpot_ms"]) == (2000.0, 150.0)
    assert report["default_vs_best_peer"] > 0 and report["best_peer"] in systems
    first, last = report["trace_indices"]
    offsets = read_trace(path).offset_ms
    assert offsets[first] >= 10_000 and offsets[last] < 40_000
    for row in report["rows"]:
        assert row["generated_tokens_per_s"] > 0 and 0 <= row["attained"] <= 1


def test_the_device_is_the_given_profile_else_a_cached_one_else_the_default_curve(tmp_path: Path) -> None:
    assert find_device(None, [tmp_path / "none.json"]).source.startswith("default curve")
    with pytest.raises(Exception, match="does not exist"):
        find_device(tmp_path / "missing.json", [])
    embed = tmp_path / "embed.json"
    embed.write_text(json.dumps({"format": "batchtide-profile/1", "model": "m", "device": "cpu", "unit": "requests",
                                 "memory_limit": 64, "points": [{"size": 1, "median_ms": 5.0}]}))  # fmt: skip
    assert find_device(None, [embed]).source.startswith("default curve"), "not a generation profile: skipped"


def test_cli_searches_the_scale_and_writes_default_vs_best_peer(tmp_path: Path) -> None:
    path = bursty_trace(tmp_path / "t.csv", n=60)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        app, ["bench", "generation", "--trace", str(path), "--quick", "--profile", str(tmp_path / "no.json")]
    )
    assert result.exit_code == 2 and "does not exist" in result.output
    result = CliRunner().invoke(app, ["bench", "generation", "--trace", str(path), "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "time scale chosen: x" in result.output and "batchtide-default / best peer goodput" in result.output
    (report,) = json.loads(out.read_text())
    assert report["time_scale_searched"] and report["search"]
    assert report["default_vs_best_peer"] > 0
    both = CliRunner().invoke(app, ["bench", "generation", "--trace", str(path), "-s", "x.toml"])
    assert both.exit_code == 2 and "--scenario FILE (one or more) or --trace FILE" in both.output


def test_cli_on_a_trace_counts_ttft_misses_beside_the_give_up_off_row(tmp_path: Path) -> None:
    """The trace mode reports the same counts as the scenario mode, and its best peer is a peer's row."""
    path = bursty_trace(tmp_path / "t.csv", n=60)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["bench", "generation", "--trace", str(path), "--time-scale", "0.5", "--quick",
                                      "--peers", "tgi", "--give-up", "both", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "TTFT late" in result.output
    (report,) = json.loads(out.read_text())
    systems = [r["system"] for r in report["rows"]]
    assert systems == ["batchtide-default", "batchtide-default, give-up off", "tgi (oracle)"]
    assert report["best_peer"] == "tgi (oracle)"
    on, off, _ = report["rows"]
    assert off["given_up"] == 0 and on["given_up"] == round(on["expired_share"] * 60)
    assert all(isinstance(r["ttft_late"], int) and isinstance(r["given_up"], int) for r in report["rows"])
