"""The demo's plan: its objectives, the load sized to what the machine served with everything
running, the profile cache key, and the verdict.

Pure functions over a profile file's content (what `batchtide profile` writes),
the answers a calibration got back, a scenario, CPU shares, the report's rows
and the answers the load got, so the sizing and the verdict are tested without
running the demo. A request of the demo's own load that is refused, fails or is
never answered fails the verdict; so does a machine whose CPU went to other
processes while the demo measured it or ran its load.

Capacity, in two measurements with the two models, the broker, the sink and
the producer sharing the cores, as in the run itself. First every model is kept
busy at once, closed loop (`served_per_s` over a calibration's answers): the
most it serves, in large batches. Then a ramp sends each model its scenario's
busiest phase, bursts included, open loop as the load arrives, at rising shares
of that rate (`ramp`); each model's capacity is its rate at the highest step
that every model met its objective at (with room where a step holds too few
requests for a p99: `step_bars`), counting from the first step and stopping at
the first miss (`capacities`). The load is sized to that capacity: a scenario keeps its shape (every rate relative to its busiest
phase); the demo scales it so that the busiest phase's base rate is `load` x
the capacity, never under LOAD_MIN, and its bursts go above that by the
scenario's own ratio.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.config import ModelConfig
from pipeline.core.sim.arrivals import make_arrivals
from pipeline.core.sim.scenario import Phase, Scenario
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


LOAD_MIN = 0.5
"""The busiest phase's base rate as a share of the co-located capacity, at least: less leaves half the
machine idle and shows nothing about batching under load."""
BUSY_MAX = 0.2
"""Share of the machine's CPU that processes outside the demo may take, over any BUSY_SPAN_S of its
profiling, calibration or load, before the verdict says the machine was busy: a quiet machine's own
daemons take a few percent, a CPU hog beside the demo (one busy loop per core) about half."""
BUSY_SPAN_S = 10.0
"""The stretch a busy spell is judged over: a p99 is made by its worst 1% of requests, which a few
seconds of another process's work can fill, where the share over a whole minute stays low."""


def served_per_s(answers_ms: list[float], start_ms: float, end_ms: float) -> float:
    """Requests/s a model served while kept busy, from the times its answers came back: the slope of
    the answers counted against time (least squares) inside [start_ms, end_ms]. A decode loop ends
    the rows it admitted together in waves; a slope through the waves reads their rate, where a count
    over the window would gain or lose a whole wave at its edges. A window whose answers span less
    than half of it (one wave) is counted over its length instead."""
    if end_ms <= start_ms:
        raise ValueError("the window must end after it starts")
    times = np.array([t for t in answers_ms if start_ms <= t <= end_ms], dtype=float)
    span = float(times.max() - times.min()) if len(times) else 0.0
    if len(times) < 3 or span < (end_ms - start_ms) / 2:
        return len(times) * 1000.0 / (end_ms - start_ms)
    times.sort()
    count = np.arange(1, len(times) + 1, dtype=float)
    slope_per_ms = np.polyfit(times - times[0], count, 1)[0]
    return float(slope_per_ms) * 1000.0


def most_in_flight(profile: dict[str, Any]) -> int:
    """Requests a calibration client may keep unanswered: two of the largest batch the profile measured
    (an encoder), or the running set the profile measured room for with the queue of joiners it
    recommends (generation: `max_inflight_batches`, of one request each)."""
    if profile.get("task") == "generate":
        recommended = profile.get("recommended", {}).get("max_inflight_batches")
        if recommended:
            return int(recommended)
        return 2 * int(profile.get("knee") or 8)
    return 2 * max(int(p["size"]) for p in profile["points"])


def busiest_rate(scenario: Scenario) -> float:
    """The base rate (bursts aside) of the scenario's busiest phase: what `load` refers to."""
    return max(phase.rate_per_s for phase in scenario.phases)


def multiplier(scenario: Scenario, capacity_per_s: float, load: float) -> float:
    """Scale of every scenario rate so its busiest phase runs at `load` x the capacity."""
    if load < LOAD_MIN:
        raise ValueError(f"load must be at least {LOAD_MIN} of the measured capacity (got {load})")
    busiest = busiest_rate(scenario)
    if busiest <= 0 or capacity_per_s <= 0:
        raise ValueError("the scenario's busiest phase and the capacity must be > 0")
    return load * capacity_per_s / busiest


def sized_load(scenario: Scenario, scale: float) -> Load:
    """The scenario's arrivals at `scale`, as a send schedule. A fixed output length is sent as
    each request's max_new_tokens (generation) and is not part of its prompt."""
    arrivals = make_arrivals(scenario, scale)
    new = scenario.output.value if scenario.output.dist == "fixed" else 0
    prompt = np.maximum(arrivals.tokens - new, 1)
    new_tokens = np.full(len(arrivals), new, dtype=np.int64) if new > 0 else None
    return Load(arrivals.create_ms, prompt, arrivals.priority, None, new_tokens)


RAMP_SHARES = (0.15, 0.25, 0.4, 0.6, 0.8, 1.0)
"""The ramp's steps, as shares of what a model served kept busy (closed loop). A closed loop keeps the
queue full, so the model runs its largest batches (an encoder) or joins rows in groups (a decode loop);
the load arrives open loop, one request at a time, in smaller batches and with a prefill per joiner, so
what meets the objective open loop lies below the closed loop's rate, by as much as the machine says:
the ramp finds it, stepping up from a sixth of it. The steps are closest where the capacity usually
falls (a quarter to a half), and the lowest is low enough that a model missing there does not serve its
scenario beside the rest: that fails the demo."""
RAMP_STEP_S = 12.0
"""Seconds per ramp step: the encoder's bursts (one every 10 s) fall in each; a generating model
answers a few requests in the lowest step, and its p99 there is their slowest."""


def ramp(
    scenario: Scenario, top_per_s: float, shares: tuple[float, ...] = RAMP_SHARES, step_s: float = RAMP_STEP_S
) -> Scenario:
    """The scenario's busiest phase (its bursts at their ratio to its base rate) repeated once per
    share, in order, each `step_s` long with its base rate at share x `top_per_s`."""
    if top_per_s <= 0 or not shares or step_s <= 0:
        raise ValueError("the ramp needs a rate > 0, at least one step and a step length > 0")
    busiest = max(scenario.phases, key=lambda phase: phase.rate_per_s)
    steps = []
    for share in shares:
        scale = share * top_per_s / busiest.rate_per_s
        bursts = busiest.bursts and replace(busiest.bursts, rate_per_s=busiest.bursts.rate_per_s * scale)
        steps.append(Phase(step_s, share * top_per_s, bursts))
    return replace(scenario, phases=tuple(steps))


def step_p99s(send_ms: np.ndarray, latency_ms: np.ndarray, step_s: float, steps: int) -> list[float]:
    """Each ramp step's p99 latency over the requests it sent (by their scheduled send time); an
    unanswered or failed request counts as infinitely late, a step that sent nothing as 0."""
    out = []
    for step in range(steps):
        inside = (send_ms >= step * step_s * 1000.0) & (send_ms < (step + 1) * step_s * 1000.0)
        taken = np.sort(np.where(np.isfinite(latency_ms[inside]), latency_ms[inside], math.inf))
        out.append(float(taken[math.ceil(0.99 * len(taken)) - 1]) if len(taken) else 0.0)
    return out


THIN_STEP = 100
"""Requests a ramp step must send for its p99 to be a 99th percentile: over fewer it is their slowest."""
THIN_STEP_ROOM = 0.8
"""A thin step (a generating model's 3-20 requests in RAMP_STEP_S) counts as met when its p99 is within
this share of the objective. The slowest of a handful stands for a lower percentile than the load's p99
over several times as many answers, and a decode loop's answer hardly gets faster at half the rate (it
is its decode steps beside the encoder), so the room has to come from the objective: judged at the full
objective, a run met its steps at up to 0.97 x by luck, sized its load from them and missed at 1.26 x."""


def step_sizes(send_ms: np.ndarray, step_s: float, steps: int) -> list[int]:
    """Requests each ramp step sent (by their scheduled send time)."""
    edges = np.arange(steps + 1) * step_s * 1000.0
    return [int(n) for n in np.histogram(send_ms, bins=edges)[0]]


def step_bars(sizes: list[int], objective_ms: float) -> list[float]:
    """The p99 each step must stay within: the objective, with THIN_STEP_ROOM for a thin step."""
    return [objective_ms * (1.0 if n >= THIN_STEP else THIN_STEP_ROOM) for n in sizes]


def steps_met(p99s: list[float], bars: list[float]) -> int:
    """How many of the ramp's steps, from the first, stayed within their bar (`step_bars`): counting
    stops at the first miss (past an overloaded step the queue it left behind decides the next one's tail)."""
    met = 0
    for p99, bar in zip(p99s, bars, strict=True):
        if p99 > bar:
            break
        met += 1
    return met


def ramp_text(rates: list[float], p99s: list[float], bars: list[float], objective_ms: float) -> str:
    """One model's ramp as the demo prints it: each step's rate and p99, a thin step starred, its bar
    named once, and how many steps from the first it met."""
    thin = sorted({bar for bar in bars if bar != objective_ms})
    each = ", ".join(
        f"{rate:.2f}/s: {p99:,.0f}{'' if bar == objective_ms else '*'}"
        for rate, p99, bar in zip(rates, p99s, bars, strict=True)
    )
    bar_text = f"within {objective_ms:,.0f} ms" + (
        f", * under {THIN_STEP} requests: within {thin[0]:,.0f} ms" if thin else ""
    )
    return f"p99 ms per step ({each}); {bar_text}; met up to step {steps_met(p99s, bars)} of {len(rates)}"


def capacities(
    rates: dict[str, list[float]], p99s: dict[str, list[float]], bars: dict[str, list[float]]
) -> dict[str, float]:
    """Each model's rate at the highest ramp step that every model met (`steps_met`); 0 for all when one
    missed the first. The models share the cores and ramp together: a step one of them missed was an
    overloaded machine for all, and the other's p99 there measured the overload, not its own rate (a
    model judged on its own ramp took a capacity read beside the other model's backlog, and a load
    at half of it left the pair's tail to chance)."""
    shared = min(steps_met(p99s[m], bars[m]) for m in rates)
    return {m: rates[m][shared - 1] if shared else 0.0 for m in rates}


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


def busy_check(while_: str, whole: float, worst: float, limit: float) -> Check:
    """Whether the machine was the demo's while it `while_` (profiled, calibrated, ran its load): other
    processes took at most `limit` of its CPU over its busiest BUSY_SPAN_S (`worst`; `whole` is the
    share over the whole window). A capacity measured beside a CPU hog is the hog's leftovers, and a
    load sized from it passes without showing what the machine serves."""
    detail = f"{worst:.0%} of its CPU went to other processes in the busiest {BUSY_SPAN_S:.0f} s ({whole:.0%} over the whole; at most {limit:.0%})"
    quiet = worst <= limit
    return Check(
        f"machine not busy while the demo {while_}", quiet, detail if quiet else f"the machine was busy: {detail}"
    )


def objective_text(slo_p99_ms: float, per_new_token_ms: float) -> str:
    """`1,000 ms`, or `1,000 ms + 250 ms per generated token`."""
    base = f"{slo_p99_ms:,.0f} ms"
    return f"{base} + {per_new_token_ms:,.0f} ms per generated token" if per_new_token_ms else base


def verdict(
    summary: list[dict[str, Any]],
    slo_rows: list[dict[str, Any]],
    answered: dict[str, tuple[int, int]],
    not_ok: dict[str, dict[str, int]] | None = None,
    busy: list[Check] | None = None,
) -> list[Check]:
    """The demo's success criteria, per model of `answered` (model -> answered, sent): every request
    answered (none lost), none refused or failed (`not_ok`: model -> counts by `outcome: reason`,
    from `not_ok_by_reason`), the e2e p99 within its objective (`slo_rows`: the report's SLO rows,
    each request judged by its own objective, slo_p99_ms + its generated tokens x
    slo_ms_per_new_token), waited > 1 s under 2%, tail-marked under 10%; then the `busy` checks."""
    rows = {row["model"]: row for row in summary}
    objectives = {row["model"]: row for row in slo_rows}
    checks = []
    for model, (got, sent) in sorted(answered.items()):
        checks.append(Check(f"{model}: every request answered", got >= sent, f"{got} of {sent}"))
        refused = (not_ok or {}).get(model, {})
        detail = ", ".join(f"{count} {reason}" for reason, count in refused.items()) or "none"
        checks.append(Check(f"{model}: none refused or failed", not refused, detail))
        row, slo = rows.get(model), objectives.get(model)
        if row is None or slo is None:
            checks.append(Check(f"{model}: in the report", False, "no latency rows"))
            continue
        p99, ratio, waited, marked = (
            math.nan if source.get(k) is None else float(source[k])
            for source, k in (
                (row, "e2e_p99_ms"),
                (slo, "p99_over_slo"),
                (row, "share_wait_over_1s"),
                (row, "marked_share"),
            )
        )
        goal = objective_text(float(slo["slo_p99_ms"]), float(slo.get("slo_ms_per_new_token") or 0.0))
        checks.append(
            Check(
                f"{model}: e2e p99 within its objective",
                ratio <= 1.0,
                f"p99 {p99:,.0f} ms, {ratio:.2f} x the objective ({goal})",
            )
        )
        checks.append(
            Check(f"{model}: waited > 1 s under {WAITED_1S_MAX:.0%}", waited < WAITED_1S_MAX, f"{waited:.2%}")
        )
        checks.append(Check(f"{model}: tail-marked under {MARKED_MAX:.0%}", marked < MARKED_MAX, f"{marked:.2%}"))
    return checks + list(busy or [])
