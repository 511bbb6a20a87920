"""`bench pipeline --runner smollm`: every batching mode at every rate, with mixed and equal lengths,
held against the machine's limit computed from the model's profile (its measured prefill and
decode-step curves)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from pipeline.bench.pipeline_options import MIXED_NEW_TOKENS, BenchOptions
from pipeline.bench.pipeline_report import describe, llm_table
from pipeline.bench.pipeline_trial import run_trial
from pipeline.core.config import KafkaSettings


def machine_limit(profile: dict[str, Any], mean_new_tokens: float) -> tuple[float, int]:
    """Generated tokens/s this device can reach for requests of `mean_new_tokens` (and the batch size
    that reaches it), from the profile's measured curves: batches of b requests that are prefilled
    once and decode together to the end, max over the measured b (no length mix wasted, no queueing)."""
    best, best_b = 0.0, 0
    for pre, step in zip(profile["prefill"], profile["points"]):
        b = pre["size"]
        rate = b * mean_new_tokens * 1000.0 / (pre["median_ms"] + mean_new_tokens * step["median_ms"])
        if rate > best:
            best, best_b = rate, b
    return best, best_b


async def llm_modes(
    options: BenchOptions, kafka: KafkaSettings, workdir: Path, say: Callable[[str], None], modes: tuple[str, ...], equal_tokens: int
) -> dict[str, Any]:
    """Every batching mode at every rate, with mixed lengths and then all equal; shares of the limit."""
    profile = json.loads(Path(options.llm_profile).read_text()) if options.llm_profile and Path(options.llm_profile).is_file() else None
    out: dict[str, Any] = {"llm_runs": [], "llm_limits": {}}
    for mix, new_tokens in (("mixed", 0), ("equal", equal_tokens)):
        mean_new = (MIXED_NEW_TOKENS[0] + MIXED_NEW_TOKENS[1]) / 2 if not new_tokens else float(new_tokens)
        limit = machine_limit(profile, mean_new) if profile else (float("nan"), 0)
        out["llm_limits"][mix] = {"generated_tokens_per_s": limit[0], "batch": limit[1], "mean_new_tokens": mean_new}
        say(
            f"max_new_tokens {'uniform %d..%d' % MIXED_NEW_TOKENS if not new_tokens else new_tokens}: machine limit "
            + (f"{limit[0]:.0f} generated tokens/s (b={limit[1]}, from the profile's prefill and decode-step curves)" if profile else "unknown (no --profile)")
        )
        for mode in modes:
            for rate in options.rates:
                trial_options = replace(options, llm_mode=mode, new_tokens=new_tokens)  # type: ignore[arg-type]
                say(f" {mix} / {mode}:")
                trial = await run_trial(trial_options, kafka, rate, workdir, say, read_events=True)
                share = trial.steady_generated_tokens_per_s / limit[0] if profile and limit[0] else float("nan")
                say(
                    describe(trial)
                    + f"\n     generated {trial.steady_generated_tokens_per_s:.1f} tokens/s in the second half of the load"
                    f" = {share:.2f} of the limit ({trial.generated_tokens_per_s:.1f} answered tokens/s over the whole run;"
                    f" drained {trial.drain_s:.0f} s, {trial.sent - trial.answered} unanswered)"
                )
                out["llm_runs"].append({"mix": mix, "mode": mode, "share_of_limit": share} | asdict(trial) | {"sustained": trial.sustained})
    say(llm_table(out))
    return out

