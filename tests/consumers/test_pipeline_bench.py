"""`bench pipeline` on the session broker: a short real run answers everything and accounts for its time;
a recorded run leaves what `batchtide replay` reads; a straggler run reports each consumer; the slowdown
hook and the fleet bench's recovery measure."""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from consumers.runners.cost_model import SlowdownHook
from pipeline.core.config import KafkaSettings, load_config
from pipeline.tools.bench.fleet_generation import BASELINE as GEN_BASELINE
from pipeline.tools.bench.fleet_generation import CASES as GEN_CASES
from pipeline.tools.bench.fleet_generation import balance_settings, generation_rows, repeat_order
from pipeline.tools.bench.fleet_live import CASES, median_trial, recovered_after_s
from pipeline.tools.bench.pipeline.event_figures import STAGES
from pipeline.tools.bench.pipeline.options import BenchOptions
from pipeline.tools.bench.pipeline.run import run_bench
from pipeline.tools.bench.pipeline.trial import WINDOW_S, Trial
from pipeline.tools.harness.events import stored_rows
from pipeline.tools.harness.processes import REPO_ROOT, child_env, cli


@pytest.mark.kafka
def test_a_short_run_answers_every_request_and_breaks_its_latency_down(kafka_settings: KafkaSettings) -> None:
    options = BenchOptions(
        runner="cost-model",
        rates=(40.0,),
        duration_s=3.0,
        cost_a_ms=4.0,
        cost_c_ms=1.0,
        bootstrap=kafka_settings.bootstrap_servers,
        partitions=2,
        tokens=10,
    )
    lines: list[str] = []
    figures = asyncio.run(run_bench(options, find_max_mode=False, rates_mode=True, say=lines.append))

    (trial,) = figures["model_trials"]
    assert trial["sent"] > 60 and trial["answered"] == trial["sent"]
    assert set(figures["model_p99_ms"]) == {"40"}
    assert 0 < figures["model_p50_ms"]["40"] <= figures["model_p99_ms"]["40"] <= figures["model_p999_ms"]["40"]
    assert figures["model_tokens_per_s"] > 0
    assert trial["mean_batch"] >= 1.0
    # the device sleeps 4 + 1*b ms per batch: the consumer's compute stamps see it
    assert trial["stages_p50_ms"]["compute"] >= 4.0
    assert set(trial["stages_p50_ms"]) == set(STAGES) == set(trial["stages_p99_ms"])
    for name in STAGES:
        assert 0 <= trial["stages_p50_ms"][name] <= trial["stages_p99_ms"][name] <= trial["max_ms"] + 1
    # the stages are consecutive spans of one request's life: their medians cannot add up past its worst end to end
    assert sum(trial["stages_p50_ms"].values()) <= trial["max_ms"] + len(STAGES)
    assert trial["consumer_cpu_ms_per_request"] > 0
    assert any("stage p50/p99 ms: kafka_in" in line for line in lines)


@pytest.mark.kafka
def test_a_recorded_run_leaves_its_events_in_a_store_that_replay_reads(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    """`--record`: the sink stores one latency row per answered request in the trial's own embedded
    store, the config the consumers ran names it, and the printed replay command replays it."""
    options = BenchOptions(
        runner="cost-model",
        rates=(40.0,),
        duration_s=3.0,
        cost_a_ms=4.0,
        cost_c_ms=1.0,
        bootstrap=kafka_settings.bootstrap_servers,
        partitions=2,
        tokens=10,
        record_dir=str(tmp_path / "rec"),
    )
    lines: list[str] = []
    figures = asyncio.run(run_bench(options, find_max_mode=False, rates_mode=True, say=lines.append))

    (trial,) = figures["model_trials"]
    directory = tmp_path / "rec" / "cost-model-40rps"
    config = load_config(directory / "batchtide.toml")
    assert Path(config.clickhouse.data_dir) == directory / "clickhouse"
    assert config.models["bench"].runner == "cost-model"
    rows = asyncio.run(stored_rows(directory / "clickhouse"))
    measured = {rid: n for rid, n in rows["raw_per_id"].items() if not rid.startswith("bench-warm-")}
    assert trial["answered"] == trial["sent"] > 60
    assert len(measured) == trial["answered"] and set(measured.values()) == {1}, "one row per answered request"
    assert lines[-1].strip() == trial["replay_command"]
    command = shlex.split(trial["replay_command"])
    assert command[:2] == ["batchtide", "replay"] and "--validate" in command
    out = tmp_path / "replay.json"
    done = subprocess.run(
        cli(*command[1:], "--replays", "1", "--json", str(out)),
        capture_output=True, text=True, cwd=REPO_ROOT, env=child_env(), timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: the prediction disagrees, still a replay
    assert "validate: predicted/recorded p99" in done.stdout
    assert json.loads(out.read_text())["recorded"]["requests"] == trial["answered"]


@pytest.mark.kafka
def test_a_straggler_run_reports_each_consumer_and_the_forwards(kafka_settings: KafkaSettings) -> None:
    """`--straggler`: consumer 0's device is 4x slower; with the group's balance on it hands work to
    consumer 1, and the trial says so per consumer."""
    options = BenchOptions(
        runner="cost-model",
        rates=(150.0,),
        duration_s=6.0,
        cost_a_ms=10.0,
        cost_c_ms=1.0,
        consumers=2,
        bootstrap=kafka_settings.bootstrap_servers,
        partitions=4,
        tokens=10,
        straggler=4.0,
    )
    figures = asyncio.run(run_bench(options, find_max_mode=False, rates_mode=True, say=lambda _: None))
    (trial,) = figures["model_trials"]
    assert trial["answered"] == trial["sent"] > 600
    assert set(trial["by_consumer"]) == {"bench-0", "bench-1"}
    assert sum(c["requests"] for c in trial["by_consumer"].values()) == trial["answered"]
    assert trial["forwarded"] > 0
    assert trial["by_consumer"]["bench-1"]["share"] > 0.5, "the fast consumer serves most of it"
    assert len(trial["p99_by_window_ms"]) == 2


def test_the_slowdown_hook_and_the_recovery_measure(tmp_path: Path) -> None:
    hook = tmp_path / "slowdown"
    slowdown = SlowdownHook(str(hook))
    assert slowdown.factor() == 1.0, "no file: full speed"
    now = time.time() * 1000.0
    hook.write_text(f"{now - 1000} {now + 60_000} 3\n")
    assert SlowdownHook(str(hook)).factor() == 3.0
    hook.write_text(f"{now + 60_000} {now + 120_000} 3\n")
    assert SlowdownHook(str(hook)).factor() == 1.0, "not yet"
    case = next(c for c in CASES if c.slowdown is not None)
    assert case.slowdown is not None
    end = case.slowdown[1]
    first_after = int(end // WINDOW_S)
    windows = [80.0] * first_after + [400.0, 300.0, 90.0, 500.0, 85.0, 80.0] + [80.0] * 4
    trial = Trial(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, p99_by_window_ms=windows)
    assert recovered_after_s(trial, case, 80.0, 1.0) == 4 * WINDOW_S, "one good window between spikes is not recovery"
    assert recovered_after_s(replace(trial, p99_by_window_ms=[80.0] * len(windows)), case, 80.0, 1.0) == 0.0
    assert recovered_after_s(replace(trial, p99_by_window_ms=[400.0] * len(windows)), case, 80.0, 1.0) == math.inf


def test_repeats_report_the_median_trial_by_p99() -> None:
    trials = [Trial(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, p99_by_window_ms=[]) for _ in range(4)]
    trials = [replace(t, p99_ms=p) for t, p in zip(trials, (120.0, 80.0, 300.0, 95.0), strict=True)]
    assert median_trial(trials[:3]).p99_ms == 120.0
    assert median_trial(trials).p99_ms == 120.0, "an even count takes the upper median: never the flattering one"
    assert median_trial(trials[1:2]).p99_ms == 80.0


def test_generation_fleet_halves_keep_every_ratio_within_one_run() -> None:
    """A slow case's balance off and on may run in two invocations: the all-equal pair with the balance on
    runs in each as the reference, and without its own balance-off run it is reported, not judged."""
    slow = next(c for c in GEN_CASES if c.name == "gen-2-slow")
    equal = next(c for c in GEN_CASES if c.name == GEN_BASELINE)
    assert balance_settings(equal, False, (False,)) == (True,)
    assert balance_settings(equal, True, (True,)) == (False, True)
    assert balance_settings(slow, True, (False,)) == (False,)
    assert balance_settings(equal, True, (True, False)) == (True, False), "in the order asked"
    assert [repeat_order((False, True), k) for k in range(3)] == [(False, True), (True, False), (False, True)]

    def trial(p99: float, ttft: float, forwarded: int = 0) -> Trial:
        blank = Trial(0, 0, 100, 100, 0, 0, 0, 0, 0, 0, 0, 0, p99_by_window_ms=[])
        return replace(blank, p99_ms=p99, ttft_p99_ms=ttft, forwarded=forwarded)

    runs = {(GEN_BASELINE, True): [trial(1000.0, 400.0)], ("gen-2-slow", False): [trial(2600.0, 900.0)]}
    rows = generation_rows([GEN_BASELINE, "gen-2-slow"], {GEN_BASELINE: (True,), "gen-2-slow": (False,)}, runs)
    reference, off = rows
    assert reference["met"] is None and math.isnan(reference["e2e_vs_baseline"])
    assert off["e2e_vs_baseline"] == 2.6 and off["ttft_vs_baseline"] == 2.25 and off["met"] is False
    runs |= {("gen-2-slow", True): [trial(1900.0, 700.0, forwarded=12)]}
    _, on = generation_rows([GEN_BASELINE, "gen-2-slow"], {GEN_BASELINE: (True,), "gen-2-slow": (True,)}, runs)
    assert on["met"] is True and on["e2e_vs_baseline"] == 1.9
    runs |= {(GEN_BASELINE, False): [trial(1000.0, 400.0)], (GEN_BASELINE, True): [trial(1060.0, 400.0, 2)]}
    _, twins = generation_rows([GEN_BASELINE], {GEN_BASELINE: (False, True)}, runs)
    assert twins["met"] is False, "equal consumers: e2e p99 6% above balance off and 2% forwarded miss"
