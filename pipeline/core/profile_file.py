"""The device profile file: a model's measured cost curve and memory limit on one device.

The one module that reads and writes the format (`batchtide-profile/1`, JSON;
every field in docs/runners.md, "The profile file"). `batchtide profile`
writes it (consumers/runners/measured_profile.py builds the content from a
measurement); `batchtide consume` loads it at start (`apply`: the engine's
`device_cap` and `prior_costs`, so the cap starts at the knee instead of
probing cold and `hard_cap = "auto"` means this memory limit);
`batchtide bench policies --profile FILE` turns it into a scenario's `[cost]`.
It is validated on load and every error names the file and the key; a file
measured for another set-up is ignored by a consumer, with a warning: a curve
from another device would mislead the engine.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, get_args

from pipeline.core.config import CostUnit, ModelConfig

FORMAT = "batchtide-profile/1"
REVISION = 3
"""Of the `recommended` section: 3 makes `hard_cap` the longest request the model admits
(max_input_tokens + max_new_tokens), so no admissible request is refused by the cap, and sizes
the running set by `target_size` (one request at the profiled prompt length). A cache of profiles
(the demo's) measures again when its revision is older."""
log = logging.getLogger("batchtide.profile")


class ProfileError(ValueError):
    """A profile file a user must fix (or re-measure); the message names the file and key."""


@dataclass(frozen=True)
class CostPoint:
    """One measured batch size."""

    size: int
    """Batch size in the profile's unit (requests, or prompt+output tokens)."""
    median_ms: float
    """Median compute time of a batch of this size."""
    p90_ms: float | None = None
    peak_memory_bytes: int | None = None
    """Peak device memory while it ran (CUDA: max_memory_allocated; CPU: RSS growth)."""


@dataclass(frozen=True)
class GenerationCurves:
    """A generating model's measured prefill and decode-step costs (what the generation simulator
    charges): prefill of a group over its padded prompt tokens, a decode step over running rows
    at one cache length, and a step at a longer cache (the longest admissible request) from which
    the per-row, per-cache-token cost of attention is taken."""

    prefill: tuple[tuple[int, float], ...]
    """(prompt tokens in the group, ms of its prefill)."""
    steps: tuple[tuple[int, int, float], ...]
    """(rows, cache tokens, ms of one decode step), at the profiled prompt length."""
    long_steps: tuple[tuple[int, int, float], ...] = ()
    """(rows, cache tokens, ms): decode steps measured at longer caches (the longest admissible request)."""


@dataclass(frozen=True)
class DeviceProfile:
    model: str
    device: str
    unit: CostUnit
    memory_limit: int
    """Largest batch (in `unit`) that fits the device's memory with headroom: the
    ceiling of `hard_cap = "auto"`."""
    points: tuple[CostPoint, ...]
    knee: int | None = None
    """Where throughput stops growing by more than the knee tolerance (informative: the
    engine re-derives it from the points)."""
    stopped_because: str = ""
    """Why measuring stopped: memory (headroom ran out), oom, budget (t(b) past it), max."""
    measured_at: str = ""
    recommended: dict[str, Any] = field(default_factory=dict)
    """Profile knobs the measurement suggests (shown, never applied silently)."""
    generation: GenerationCurves | None = None
    """Generation: the prefill and decode-step curves (None for other models, and for a compact file)."""

    def cost_points(self) -> list[tuple[int, float]]:
        return [(p.size, p.median_ms) for p in self.points]

    def items_per_s(self) -> list[tuple[int, float]]:
        return [(p.size, 1000.0 * p.size / p.median_ms) for p in self.points]

    def scenario_cost(self) -> dict[str, Any]:
        """The `[cost]` table of a scenario that charges what this device measured.

        The simulator's `max_batch` counts requests; a token profile's limit is in
        tokens, so it bounds batches only through the curve (left out here)."""
        table: dict[str, Any] = {
            "unit": self.unit,
            "points": [[p.size, p.median_ms] for p in self.points],
        }
        if self.unit == "requests":
            table["max_batch"] = self.memory_limit
        return table

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("generation")
        out["points"] = [{k: v for k, v in asdict(p).items() if v is not None} for p in self.points]
        return {"format": FORMAT, **out}

    def write(self, path: str | Path) -> Path:
        return write(self.to_json(), Path(path))


def _positive(where: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where}: expected a number, got {value!r}")
    if kind is int and not isinstance(value, int):
        raise ProfileError(f"{where}: expected a whole number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ProfileError(f"{where}: must be > 0 (got {value!r})")
    return kind(value)


def _from_measurement(data: dict[str, Any]) -> dict[str, Any]:
    """The file `batchtide profile` writes (raw sweeps plus `cost_points` in the engine's unit)
    in the compact layout (`points`, `memory_limit`): the engine's curve is `cost_points`, the
    device limit is the measured memory limit (or the largest size measured when memory never
    ran out)."""
    points = [{"size": int(size), "median_ms": float(ms)} for size, ms in data["cost_points"]]
    memory = data.get("memory") or {}
    limit = memory.get("limit_units") or max((p["size"] for p in points), default=None)
    return {
        "format": data.get("format"),
        "model": data.get("model"),
        "device": data.get("device", ""),
        "unit": data.get("unit"),
        "memory_limit": limit,
        "points": points,
        "knee": data.get("knee") if data.get("task") != "generate" else None,
        "stopped_because": data.get("stop_reason", ""),
        "recommended": data.get("recommended", {}),
    }


def _generation_curves(data: dict[str, Any], source: str) -> GenerationCurves | None:
    """The prefill and decode-step curves of a measurement file (`task = "generate"`)."""
    if data.get("task") != "generate" or not data.get("prefill"):
        return None

    def point(where: str, raw: Any) -> tuple[int, int, float]:
        if not isinstance(raw, dict):
            raise ProfileError(f"{where}: expected an object with size, tokens and median_ms")
        return (
            _positive(f"{where}.size", raw.get("size"), int),
            _positive(f"{where}.tokens", raw.get("tokens"), int),
            _positive(f"{where}.median_ms", raw.get("median_ms"), float),
        )

    prefill = [point(f"{source}.prefill[{i}]", raw) for i, raw in enumerate(data["prefill"])]
    steps = [point(f"{source}.points[{i}]", raw) for i, raw in enumerate(data["points"])]
    long_steps = []
    longest = data.get("longest") or {}
    if longest.get("prefill") and longest.get("step"):
        pre = point(f"{source}.longest.prefill", longest["prefill"])
        prefill.append(pre)
        long_steps.append(point(f"{source}.longest.step", longest["step"]))
    by_tokens: dict[int, float] = {}
    for _, tokens, ms in prefill:
        by_tokens.setdefault(tokens, ms)
    return GenerationCurves(
        prefill=tuple(sorted(by_tokens.items())),
        steps=tuple(steps),
        long_steps=tuple(long_steps),
    )


def parse_profile(data: Any, source: str = "<profile>") -> DeviceProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a JSON object")
    generation = None
    if isinstance(data.get("cost_points"), list):
        generation = _generation_curves(data, source)
        data = _from_measurement(data)
    if data.get("format") != FORMAT:
        raise ProfileError(f"{source}.format: expected {FORMAT!r}, got {data.get('format')!r}")
    known = {
        "format",
        "model",
        "device",
        "unit",
        "memory_limit",
        "points",
        "knee",
        "stopped_because",
        "measured_at",
        "recommended",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    for key in ("model", "unit", "memory_limit", "points"):
        if key not in data:
            raise ProfileError(f"{source}: missing key {key!r}")
    unit = data["unit"]
    if unit not in get_args(CostUnit):
        raise ProfileError(f"{source}.unit: {unit!r} is not one of {list(get_args(CostUnit))}")
    raw_points = data["points"]
    if not isinstance(raw_points, list) or not raw_points:
        raise ProfileError(f"{source}.points: expected a non-empty list of measured sizes")
    points: list[CostPoint] = []
    for i, raw in enumerate(raw_points):
        where = f"{source}.points[{i}]"
        if not isinstance(raw, dict) or "size" not in raw or "median_ms" not in raw:
            raise ProfileError(f"{where}: expected an object with size and median_ms")
        p90 = raw.get("p90_ms")
        memory = raw.get("peak_memory_bytes")
        points.append(
            CostPoint(
                size=_positive(f"{where}.size", raw["size"], int),
                median_ms=_positive(f"{where}.median_ms", raw["median_ms"], float),
                p90_ms=None if p90 is None else _positive(f"{where}.p90_ms", p90, float),
                peak_memory_bytes=None if memory is None else int(_positive(f"{where}.peak_memory_bytes", memory, int)),
            )
        )
    sizes = [p.size for p in points]
    if sizes != sorted(set(sizes)):
        raise ProfileError(f"{source}.points: sizes must be increasing and distinct (got {sizes})")
    limit = _positive(f"{source}.memory_limit", data["memory_limit"], int)
    knee = data.get("knee")
    recommended = data.get("recommended", {})
    if not isinstance(recommended, dict):
        raise ProfileError(f"{source}.recommended: expected an object")
    return DeviceProfile(
        model=str(data["model"]),
        device=str(data.get("device", "")),
        unit=unit,
        memory_limit=limit,
        points=tuple(points),
        knee=None if knee is None else _positive(f"{source}.knee", knee, int),
        stopped_because=str(data.get("stopped_because", "")),
        measured_at=str(data.get("measured_at", "")),
        recommended=recommended,
        generation=generation,
    )


def load_profile(path: str | Path) -> DeviceProfile:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile file {p} does not exist (run `batchtide profile`)") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p}: not valid JSON: {e}") from None
    return parse_profile(data, str(p))


def profile_path(model: str) -> Path:
    """Where a consumer of `model` looks for its profile: `<BATCHTIDE_PROFILE_DIR or var/profiles>/<model>.json`."""
    return Path(os.environ.get("BATCHTIDE_PROFILE_DIR", "var/profiles")) / f"{model}.json"


def write(profile: dict[str, Any], path: Path) -> Path:
    """Write a profile atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(json.dumps(profile, indent=1) + "\n")
    scratch.replace(path)
    return path


def read(path: Path) -> dict[str, Any]:
    """The raw JSON of a profile (either layout), checked only for its format."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: not a {FORMAT} file (format {found!r})")
    return data


def longest_request(model: ModelConfig, max_prompt_tokens: int = 0) -> int:
    """Tokens of the longest request the model admits: its longest prompt (`max_input_tokens`,
    or what the runner lowered it to for the position table) plus `max_new_tokens`."""
    prompt = min(max_prompt_tokens, model.max_input_tokens) if max_prompt_tokens else model.max_input_tokens
    return prompt + (model.max_new_tokens if model.task != "embed" else 0)


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
        log.warning(
            "profile %s is in %s, the model batches in %s: cap and curve not used",
            path,
            measured.unit,
            model.profile.cost_unit,
        )
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
    log.info(
        "profile %s: device limit %d %s, %d measured points seed the cost curve",
        path,
        limit,
        measured.unit,
        len(points),
    )
    return {"device_cap": limit, "prior_costs": points}
