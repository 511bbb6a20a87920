"""The demo's plan: load sized to the measured capacity, the profile cache key, and the verdict.

Pure functions over a profile file's content (what `batchtide profile` writes),
a scenario, the report's summary rows and the answers the load got, so the
sizing and the verdict are tested without running the demo. A request of the
demo's own load that is refused, fails or is never answered fails the verdict.

Capacity: the profile's throughput at the knee (items/s for an encoder; for
generation, requests/s of a running set of knee rows, each paying its share
of the prefill and `max_new_tokens` decode steps), times a de-rating factor:
the profile ran alone on the machine, the demo's consumers share its cores
with the broker, the sink, the producer and each other. A scenario keeps its
shape (every rate relative to its busiest phase); the demo scales it so that
the busiest phase's base rate is `load` x the de-rated capacity, and its
bursts go above that by the scenario's own ratio.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.config import ModelConfig
from pipeline.core.sim.arrivals import make_arrivals
from pipeline.core.sim.scenario import Scenario
from pipeline.tools.devtools.producer import Load

WAITED_1S_MAX = 0.02
"""Share of requests that may wait over 1 s in the queue (issue 11's goal)."""
MARKED_MAX = 0.10
"""Share of requests that may be tail-marked: more, and marking singles out nothing."""


@dataclass(frozen=True)
class Capacity:
    """What one consumer of the model serves per second at the knee, alone on the device."""

    knee: int
    """Batch size (requests; running rows for generation) at the knee."""
    requests_per_s: float
    tokens_per_s: float
    """Input tokens/s (encoder) or generated tokens/s (generation)."""
    service_ms: float
    """Time one knee batch takes: a whole batch, or prefill + max_new_tokens decode steps."""


def capacity(profile: dict[str, Any], max_new_tokens: int) -> Capacity:
    """The knee's throughput in a profile file (`batchtide profile` output)."""
    points = {p["size"]: p for p in profile["points"]}
    if not points:
        raise ValueError(f"profile of {profile.get('model')!r} has no measured points")
    knee = int(profile.get("knee") or min(points))
    if knee not in points:
        knee = max(size for size in points if size <= knee) if any(s <= knee for s in points) else min(points)
    step = points[knee]
    if profile.get("task") != "generate":
        return Capacity(knee, float(step["items_per_s"]), float(step["tokens_per_s"]), float(step["median_ms"]))
    prefill = {p["size"]: p for p in profile.get("prefill", [])}
    prefill_ms = float(prefill[knee]["median_ms"]) if knee in prefill else 0.0
    service = prefill_ms + max_new_tokens * float(step["median_ms"])
    per_s = knee * 1000.0 / service
    return Capacity(knee, per_s, per_s * max_new_tokens, service)


def busiest_rate(scenario: Scenario) -> float:
    """The base rate (bursts aside) of the scenario's busiest phase: what `load` refers to."""
    return max(phase.rate_per_s for phase in scenario.phases)


def multiplier(scenario: Scenario, capacity_per_s: float, load: float, derate: float) -> float:
    """Scale of every scenario rate so its busiest phase runs at `load` x the de-rated capacity."""
    if not 0 < load or not 0 < derate <= 1:
        raise ValueError(f"load must be > 0 and derate in (0, 1] (got {load}, {derate})")
    busiest = busiest_rate(scenario)
    if busiest <= 0 or capacity_per_s <= 0:
        raise ValueError("the scenario's busiest phase and the capacity must be > 0")
    return load * derate * capacity_per_s / busiest


def sized_load(scenario: Scenario, scale: float) -> Load:
    """The scenario's arrivals at `scale`, as a send schedule. A fixed output length is sent as
    each request's max_new_tokens (generation) and is not part of its prompt."""
    arrivals = make_arrivals(scenario, scale)
    new = scenario.output.value if scenario.output.dist == "fixed" else 0
    prompt = np.maximum(arrivals.tokens - new, 1)
    new_tokens = np.full(len(arrivals), new, dtype=np.int64) if new > 0 else None
    return Load(arrivals.create_ms, prompt, arrivals.priority, None, new_tokens)


GENERATION_SLO_FACTOR = 5.0
"""A generated answer's p99 objective in lone-request service times (as profiled alone): 2x for
cores shared with the encoder, broker and sink (the demo's de-rating), 2.5x for waiting to join a
running set and sharing its decode steps. Measured in the demo: p99 2.0-3.8x."""


def generation_slo_ms(profile: dict[str, Any], max_new_tokens: int) -> float:
    """An end-to-end p99 objective that scales with max_new_tokens: GENERATION_SLO_FACTOR x a lone
    request's prefill + max_new_tokens decode steps as profiled here, rounded up to 500 ms."""
    prefill = min(profile["prefill"], key=lambda p: p["size"])
    step = min(profile["points"], key=lambda p: p["size"])
    lone_ms = float(prefill["median_ms"]) + max_new_tokens * float(step["median_ms"])
    return math.ceil(GENERATION_SLO_FACTOR * lone_ms / 500.0) * 500.0


def machine_fingerprint() -> str:
    """CPU model, core count and architecture: a profile measured elsewhere does not describe this machine."""
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}|{os.cpu_count()}|{platform.machine()}"


def cache_key(model: ModelConfig, fingerprint: str) -> str:
    """Everything a measurement depends on: the model, how it runs, and the machine."""
    parts = {
        "model_path": model.model_path,
        "runner": model.runner,
        "task": model.task,
        "device": model.device,
        "torch_threads": model.torch_threads,
        "max_new_tokens": model.max_new_tokens if model.task == "generate" else 0,
        "machine": fingerprint,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return f"{model.name}-{digest}"


def speed_seen(profile: dict[str, Any], compute_rows: list[dict[str, Any]]) -> tuple[float, int] | None:
    """How fast the model's batches ran in the pipeline against the profile (profiled median /
    recorded median, weighted by batches, at the sizes both measured) and over how many batches:
    the de-rating the run actually saw, compute only. None without a common size. Encoders only:
    an iteration-level batch's compute time is its requests' whole decode, not one step."""
    if profile.get("task") == "generate":
        return None
    profiled = {p["size"]: float(p["median_ms"]) for p in profile["points"]}
    pairs = [
        (profiled[r["size"]] / float(r["compute_p50_ms"]), int(r["batches"]))
        for r in compute_rows
        if r["size"] in profiled and r.get("compute_p50_ms")
    ]
    batches = sum(n for _, n in pairs)
    if not batches:
        return None
    return sum(ratio * n for ratio, n in pairs) / batches, batches


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


OVERSIZE_TEXT = "is larger than max.message.bytes"
"""What an answer shrunk to `error` for its topic says (consumers.answers)."""


def not_ok_reason(outcome: str, error: str | None) -> str:
    """Why an answer the client got is not `ok`, as `outcome: reason`: a refusal's reason code
    (its error reads `reason: detail`), `oversize` or `runner_error` for an error, `deadline`."""
    text = error or ""
    if outcome == "rejected":
        reason = text.split(":", 1)[0].strip() or "unknown"
    elif outcome == "error":
        reason = "oversize" if OVERSIZE_TEXT in text else "runner_error"
    else:
        reason = "deadline"
    return f"{outcome}: {reason}"


def not_ok_by_reason(answers: dict[str, tuple[str, str | None]]) -> dict[str, int]:
    """Answers (request id -> outcome, error) that are not `ok`, counted by `not_ok_reason`."""
    counts: dict[str, int] = {}
    for outcome, error in answers.values():
        if outcome != "ok":
            key = not_ok_reason(outcome, error)
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def verdict(
    summary: list[dict[str, Any]],
    slo_ms: dict[str, float],
    answered: dict[str, tuple[int, int]],
    not_ok: dict[str, dict[str, int]] | None = None,
) -> list[Check]:
    """The demo's success criteria from the report's per-model summary rows and the answers its
    load got: every request answered (none lost), none refused or failed (`not_ok`: model ->
    counts by `outcome: reason`, from `not_ok_by_reason`), p99 within each model's SLO, waited
    > 1 s under 2%, tail-marked under 10%."""
    rows = {row["model"]: row for row in summary}
    checks = []
    for model, (got, sent) in sorted(answered.items()):
        checks.append(Check(f"{model}: every request answered", got >= sent, f"{got} of {sent}"))
        refused = (not_ok or {}).get(model, {})
        detail = ", ".join(f"{count} {reason}" for reason, count in refused.items()) or "none"
        checks.append(Check(f"{model}: none refused or failed", not refused, detail))
    for model, slo in sorted(slo_ms.items()):
        row = rows.get(model)
        if row is None:
            checks.append(Check(f"{model}: in the report", False, "no latency rows"))
            continue
        p99, waited, marked = (
            math.nan if row.get(k) is None else float(row[k])
            for k in ("e2e_p99_ms", "share_wait_over_1s", "marked_share")
        )
        checks.append(Check(f"{model}: e2e p99 within the SLO", p99 <= slo, f"{p99:,.0f} ms <= {slo:,.0f} ms"))
        checks.append(
            Check(f"{model}: waited > 1 s under {WAITED_1S_MAX:.0%}", waited < WAITED_1S_MAX, f"{waited:.2%}")
        )
        checks.append(Check(f"{model}: tail-marked under {MARKED_MAX:.0%}", marked < MARKED_MAX, f"{marked:.2%}"))
    return checks
