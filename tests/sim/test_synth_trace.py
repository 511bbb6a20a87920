"""Synthetic traces of other workloads: each shape as its docstring says, written in the common format,
the same for the same seed; and the generation bench's grid runs spread over processes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.sim.generation.synth_trace import SHAPES, synth_trace
from pipeline.core.sim.generation.trace import TraceSlice, read_trace, write_trace
from pipeline.tools.bench.generation import GenWorkload, best_peers, grids
from pipeline.tools.bench.generation_trace import DEFAULT_CURVE, TraceDevice, burst_prefill_scale, trace_workload


def test_a_conversation_follows_a_day_with_medium_prompts_and_short_answers() -> None:
    made = synth_trace("conversation", 3000, seed=3)
    span = made.offset_s[-1]
    edges = np.histogram(made.offset_s % 3600.0, bins=[0, 600, 1500, 2100, 3000, 3600])[0]
    assert edges[2] / 600 > 2.5 * edges[0] / 600, edges  # the middle of the day is busier than its start
    assert 2000 < span < 5000
    assert 700 < np.median(made.prompt) < 1400 and 40 < np.median(made.answer) < 90
    assert np.median(made.answer) < np.median(made.prompt) / 10


def test_summarization_has_long_prompts_and_long_answers_at_a_steady_rate() -> None:
    made = synth_trace("summarization", 2000, seed=3)
    assert 2500 < np.median(made.prompt) < 3500 and 200 < np.median(made.answer) < 300
    halves = np.histogram(made.offset_s, bins=2)[0]
    assert abs(halves[0] - halves[1]) < 0.1 * len(made.offset_s)


def test_bursty_puts_tens_of_requests_within_a_second_and_mixes_two_prompt_kinds() -> None:
    made = synth_trace("bursty", 3000, seed=3)
    per_second = np.bincount(made.offset_s.astype(int))
    assert per_second.max() >= 10 and (per_second >= 10).sum() >= 20
    short, long = (made.prompt < 800).mean(), (made.prompt > 1200).mean()
    assert 0.55 < short < 0.8 and 0.2 < long < 0.4


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_shape_is_the_same_for_the_same_seed_and_starts_at_zero(shape: str) -> None:
    one, again, other = synth_trace(shape, 500, 7), synth_trace(shape, 500, 7), synth_trace(shape, 500, 8)
    assert one.offset_s.tolist() == again.offset_s.tolist() and one.prompt.tolist() == again.prompt.tolist()
    assert one.prompt.tolist() != other.prompt.tolist()
    assert one.offset_s[0] == 0.0 and np.all(np.diff(one.offset_s) >= 0)
    assert one.prompt.min() >= 1 and one.answer.min() >= 1 and len(one.prompt) == 500


def test_an_unknown_shape_or_too_few_requests_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown trace shape"):
        synth_trace("chitchat", 100)
    with pytest.raises(ValueError, match="at least 2"):
        synth_trace("bursty", 1)


def test_the_command_writes_a_trace_the_bench_reads(tmp_path: Path) -> None:
    out = tmp_path / "conv.csv"
    result = CliRunner().invoke(app, ["bench", "synth-trace", "conversation", "--requests", "300", "--out", str(out)])
    assert result.exit_code == 0, result.output
    trace = read_trace(out)
    made = synth_trace("conversation", 300, 0)
    assert len(trace) == 300 and trace.prompt.tolist() == made.prompt.tolist()
    assert trace.offset_ms == pytest.approx(made.offset_s * 1000.0, abs=1e-3)
    bad = CliRunner().invoke(app, ["bench", "synth-trace", "chitchat", "--out", str(out)])
    assert bad.exit_code == 2 and "unknown trace shape" in bad.output


def _workload(tmp_path: Path) -> GenWorkload:
    made = synth_trace("bursty", 120, seed=2)
    path = write_trace(tmp_path / "b.csv", made.offset_s / 20.0, made.prompt // 4 + 1, made.answer)
    sliced = TraceSlice(time_scale=4.0).apply(read_trace(path))
    return trace_workload(sliced, TraceDevice(DEFAULT_CURVE, 60_000, "test"), 3000.0, 150.0, "b")


def test_grid_runs_over_processes_give_the_rows_of_one(tmp_path: Path) -> None:
    workload = _workload(tmp_path)
    one = best_peers(workload, quick=True)
    two = best_peers(workload, quick=True, jobs=2)
    assert [(r.system, r.config, r.goodput_rps, r.ttft_p99_ms) for r in one] == [
        (r.system, r.config, r.goodput_rps, r.ttft_p99_ms) for r in two
    ]


def test_vllm_tries_its_priority_policy_only_where_requests_differ_in_priority(tmp_path: Path) -> None:
    workload = _workload(tmp_path)
    assert not any("priority" in label for label, _ in grids(workload, quick=True)["vllm"])
    arr = workload.arrivals
    mixed = replace(workload, arrivals=replace(arr, priority=np.arange(len(arr)) % 2))
    labels = [label for label, _ in grids(mixed, quick=True)["vllm"]]
    assert sum("priority" in label for label in labels) == sum("fcfs" in label for label in labels) > 0


def test_a_bench_split_by_peer_family_gives_that_familys_row_as_the_whole_does(tmp_path: Path) -> None:
    workload = _workload(tmp_path)
    whole = {r.system: r for r in best_peers(workload, quick=True)}
    part = best_peers(workload, quick=True, only=("sglang", "tgi"))
    assert [r.system for r in part] == ["tgi (oracle)", "sglang (oracle)"]
    assert all(r == replace(whole[r.system], wall_s=r.wall_s) for r in part)
    trace = tmp_path / "t.csv"
    CliRunner().invoke(app, ["bench", "synth-trace", "bursty", "--requests", "50", "--out", str(trace)])
    bad = CliRunner().invoke(app, ["bench", "generation", "--trace", str(trace), "--peers", "vllm,orca"])
    assert bad.exit_code == 2 and "unknown orca" in bad.output


def test_the_scale_search_starts_where_a_burst_of_prefills_fits_the_ttft_objective(tmp_path: Path) -> None:
    # bursts of 10 prompts 0.1 s apart, 100 s between bursts; each prompt's lone prefill is 1 s on the
    # default curve (10.12 + 0.12 ms a token past the first): a 3 s objective holds 3 of them, so their
    # arrivals must spread to 0.3 s of trace time per objective: a scale of 10
    offsets = np.concatenate([b * 100.0 + np.arange(10) * 0.1 for b in range(5)])
    path = write_trace(tmp_path / "b.csv", offsets, np.full(50, 8250), np.full(50, 4))
    sliced = TraceSlice().apply(read_trace(path))
    assert DEFAULT_CURVE.prefill_ms(1, 1) + 8249 * DEFAULT_CURVE.prompt_token_ms() == pytest.approx(1000.0)
    assert burst_prefill_scale(sliced, DEFAULT_CURVE, 3000.0, 1.0) == pytest.approx(10.0, rel=0.02)
    # twice the objective holds twice the prompts in twice the time: the same scale
    assert burst_prefill_scale(sliced, DEFAULT_CURVE, 6000.0, 1.0) == pytest.approx(10.0, rel=0.02)
    # the last 3 of each burst fit at any scale (nothing behind them): asking that of 30% needs no stretch
    assert burst_prefill_scale(sliced, DEFAULT_CURVE, 3000.0, 0.3) < 0.1
    assert burst_prefill_scale(sliced, DEFAULT_CURVE, 3000.0, 0.8) == pytest.approx(10.0, rel=0.02)
