"""The profile file's content for a measurement: the measured curves and what they recommend.

`batchtide profile` measures (consumers/runners/profile.py), this module turns
the measurement into the file's content, and pipeline/core/profile_file.py (the one
module that reads and writes the format, documented in docs/runners.md) writes it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pipeline.core.config import ModelConfig
from pipeline.core.profile_file import FORMAT, REVISION, longest_request

from .iteration import JOIN_SLOTS
from .profile import Measurement, bytes_per_unit, knee, memory_limit_units


def engine_points(found: Measurement, new_tokens: int) -> list[tuple[int, float]]:
    """(size in the profile's unit, ms of one batch): whole batches, or for generation a static
    batch of b prompts generating `new_tokens` each (prefill + that many decode steps), in tokens."""
    if found.task != "generate":
        return [(p.size, round(p.median_ms, 3)) for p in found.points]
    out = []
    for pre, step in zip(found.prefill, found.points, strict=True):
        tokens = pre.size * (found.prompt_tokens + new_tokens)
        out.append((tokens, round(pre.median_ms + new_tokens * step.median_ms, 3)))
    return out


def build(found: Measurement, model: ModelConfig, *, simulated: bool) -> dict[str, Any]:
    """The profile file's content for a measurement of `model`."""
    generate = found.task == "generate"
    unit = "tokens" if generate else "requests"
    knee_size = knee(found.points) if found.points else 1
    within_budget = max((p.size for p in found.points if p.median_ms <= found.budget_ms), default=1)
    memory_units = memory_limit_units(found)
    if generate:
        # iteration-level: a batch is one request at the profiled prompt length (target_size), so
        # answers go out as each request ends; the cap is the longest request the model admits, so
        # none is refused by it. The running set holds the decode knee's rows of target-size
        # requests (throughput; the step budget only shapes a short queue), within memory;
        # JOIN_SLOTS more batches wait to join in groups.
        typical = found.prompt_tokens + model.max_new_tokens
        longest = longest_request(model, found.max_prompt_tokens)
        rows = knee_size if not memory_units else max(1, min(knee_size, memory_units // typical))
        recommended = {
            "cost_unit": "tokens",
            "hard_cap": longest,
            "target_size": min(typical, longest),
            "batching": "iteration",
            "max_inflight_batches": rows + JOIN_SLOTS,
            "running_tokens": max(longest, rows * typical),
        }
    else:
        hard_cap = min(within_budget, memory_units) if memory_units else within_budget
        recommended = {"cost_unit": "requests", "hard_cap": hard_cap, "target_size": max(1, min(hard_cap, knee_size))}
    recommended["compute_budget_ms"] = found.budget_ms
    recommended["revision"] = REVISION
    return {
        "format": FORMAT,
        "model": model.name,
        "model_path": model.model_path,
        "runner": model.runner,
        "simulated": simulated,
        "task": found.task,
        "device": found.device,
        "torch_threads": model.torch_threads,
        "unit": unit,
        "memory": {
            "kind": found.memory_kind,
            "limit_bytes": found.memory_limit_bytes,
            "base_bytes": found.base_bytes,
            "bytes_per_unit": round(bytes_per_unit(found), 1),
            "limit_units": memory_units,
        },
        "budget_ms": found.budget_ms,
        "stop_reason": found.stop_reason,
        "knee": knee_size,
        "points": [asdict(p) for p in found.points],
        "prefill": [asdict(p) for p in found.prefill],
        "prompt_tokens": found.prompt_tokens,
        "decode_steps": found.decode_steps,
        "longest": _longest_of(found) if generate else None,
        "cost_points": engine_points(found, model.max_new_tokens),
        "recommended": recommended,
    }


def _longest_of(found: Measurement) -> dict[str, Any]:
    """The longest admissible request as measured: prompt tokens, its prefill and decode step
    (null on OOM: the device cannot hold a request the config admits)."""
    prefill, step = found.longest if found.longest else (None, None)
    return {
        "prompt_tokens": found.max_prompt_tokens,
        "prefill": asdict(prefill) if prefill else None,
        "step": asdict(step) if step else None,
    }
