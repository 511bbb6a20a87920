"""The device profile file: a model's measured cost curve and memory limit on one device.

`batchtide profile` writes it; `batchtide consume` loads it at start (the
engine's `device_cap` and `prior_costs`: the cap starts at the knee instead of
probing cold, and `hard_cap = "auto"` means this memory limit);
`batchtide bench policies --profile FILE` turns it into a scenario's `[cost]`.
One JSON object (format in docs/benchmarks.md)::

    {"format": "batchtide-profile/1", "model": "minilm", "device": "cpu",
     "unit": "requests", "memory_limit": 256, "knee": 16,
     "points": [{"size": 1, "median_ms": 17.0, "p90_ms": 19.5,
                 "peak_memory_bytes": 61000000}, ...]}

It is validated on load and every error names the file and the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import CostUnit

FORMAT = "batchtide-profile/1"


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

    def cost_points(self) -> list[tuple[int, float]]:
        return [(p.size, p.median_ms) for p in self.points]

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments of BatchingEngine for a consumer on this device."""
        return {"device_cap": self.memory_limit, "prior_costs": self.cost_points()}

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
        out["points"] = [{k: v for k, v in asdict(p).items() if v is not None} for p in self.points]
        return {"format": FORMAT, **out}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


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
    in the compact layout above: the engine's curve is `cost_points`, the device limit is the
    measured memory limit (or the largest size measured when memory never ran out)."""
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


def parse_profile(data: Any, source: str = "<profile>") -> DeviceProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a JSON object")
    if isinstance(data.get("cost_points"), list):
        data = _from_measurement(data)
    if data.get("format") != FORMAT:
        raise ProfileError(f"{source}.format: expected {FORMAT!r}, got {data.get('format')!r}")
    known = {"format", "model", "device", "unit", "memory_limit", "points", "knee",
             "stopped_because", "measured_at", "recommended"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    for key in ("model", "unit", "memory_limit", "points"):
        if key not in data:
            raise ProfileError(f"{source}: missing key {key!r}")
    unit = data["unit"]
    if unit not in ("requests", "tokens"):
        raise ProfileError(f"{source}.unit: {unit!r} is not one of ['requests', 'tokens']")
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
        points.append(CostPoint(
            size=_positive(f"{where}.size", raw["size"], int),
            median_ms=_positive(f"{where}.median_ms", raw["median_ms"], float),
            p90_ms=None if p90 is None else _positive(f"{where}.p90_ms", p90, float),
            peak_memory_bytes=None if memory is None else int(_positive(f"{where}.peak_memory_bytes", memory, int)),
        ))
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
