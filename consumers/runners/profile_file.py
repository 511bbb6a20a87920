"""The profile file: what `batchtide profile` measured, and how a consumer starts from it.

JSON, one file per model (`<BATCHTIDE_PROFILE_DIR or var/profiles>/<model>.json`);
the format is described field by field in docs/runners.md. A consumer that
finds its model's file at start (and the file was measured for the same
model_path, task, device kind and torch threads) begins with the measured
cost curve instead of probing cold, and never lets its cap above the
device's measured limit. A file for another set-up is ignored with a
warning: a curve from another device would mislead the engine.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.config import ModelConfig
from pipeline.profile_file import parse_profile

from .iteration import JOIN_SLOTS
from .profile import Measurement, Point, bytes_per_unit, knee, memory_limit_units

FORMAT = "batchtide-profile/1"
REVISION = 3
"""Of the `recommended` section: 3 makes `hard_cap` the longest request the model admits
(max_input_tokens + max_new_tokens), so no admissible request is refused by the cap, and sizes
the running set by `target_size` (one request at the profiled prompt length). A cache of profiles
(the demo's) measures again when its revision is older."""
log = logging.getLogger("batchtide.profile")


def profile_path(model: str) -> Path:
    return Path(os.environ.get("BATCHTIDE_PROFILE_DIR", "var/profiles")) / f"{model}.json"


def engine_points(found: Measurement, new_tokens: int) -> list[tuple[int, float]]:
    """(size in the profile's unit, ms of one batch): whole batches, or for generation a static
    batch of b prompts generating `new_tokens` each (prefill + that many decode steps), in tokens."""
    if found.task != "generate":
        return [(p.size, round(p.median_ms, 3)) for p in found.points]
    out = []
    for pre, step in zip(found.prefill, found.points):
        tokens = pre.size * (found.prompt_tokens + new_tokens)
        out.append((tokens, round(pre.median_ms + new_tokens * step.median_ms, 3)))
    return out


def longest_request(model: ModelConfig, max_prompt_tokens: int = 0) -> int:
    """Tokens of the longest request the model admits: its longest prompt (`max_input_tokens`,
    or what the runner lowered it to for the position table) plus `max_new_tokens`."""
    prompt = min(max_prompt_tokens, model.max_input_tokens) if max_prompt_tokens else model.max_input_tokens
    return prompt + (model.max_new_tokens if model.task != "embed" else 0)


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


def write(profile: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(json.dumps(profile, indent=1) + "\n")
    scratch.replace(path)
    return path


def read(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (format {data.get('format')!r})")
    return data


def points_of(profile: dict[str, Any], key: str = "points") -> list[Point]:
    return [Point(**p) for p in profile.get(key, [])]


def matches(profile: dict[str, Any], model: ModelConfig) -> str | None:
    """Why this profile does not describe `model` as configured, or None."""
    device = model.device if model.device != "auto" else None
    checks = [
        ("model_path", profile.get("model_path"), model.model_path),
        ("runner", profile.get("runner"), model.runner),
        ("torch_threads", profile.get("torch_threads"), model.torch_threads),
    ]
    if device is not None:
        checks.append(("device", str(profile.get("device", "")).split(":")[0], device.split(":")[0]))
    if model.task != "auto":
        checks.append(("task", profile.get("task"), model.task))
    for name, theirs, ours in checks:
        if theirs != ours:
            return f"measured with {name} {theirs!r}, the model has {ours!r}"
    return None


def apply(model: ModelConfig, path: Path | None = None) -> dict[str, Any]:
    """BatchingEngine keyword arguments from the model's profile file: the device limit as
    `device_cap` (the ceiling of hard_cap = "auto", and a bound on an explicit one) and the
    measured curve as `prior_costs`. No file, or one for another set-up: no arguments.
    """
    path = path or profile_path(model.name)
    if not path.is_file():
        return {}
    try:
        raw = read(path)
        measured = parse_profile(raw, str(path))
    except (OSError, ValueError) as e:
        log.warning("profile %s ignored: %s", path, e)
        return {}
    why = matches(raw, model)
    if why is not None:
        log.warning("profile %s ignored: %s", path, why)
        return {}
    if measured.unit != model.profile.cost_unit:
        log.warning("profile %s is in %s, the model batches in %s: cap and curve not used", path, measured.unit, model.profile.cost_unit)
        return {}
    recommended = raw["recommended"]
    # an iteration-level batch is one of several in the running set, and holds at least the longest
    # request the model admits (a profile measured with a shorter max_input_tokens, or of an older
    # revision, never makes the consumer refuse one); a static batch may fill the device
    if model.batching == "iteration":
        limit = max(int(recommended["hard_cap"]), longest_request(model))
    else:
        limit = measured.memory_limit
    points = [(size, ms) for size, ms in measured.cost_points() if size <= limit]
    log.info("profile %s: device limit %d %s, %d measured points seed the cost curve", path, limit, measured.unit, len(points))
    return {"device_cap": limit, "prior_costs": points}
