"""Scenario files (TOML): read, validated, every error naming the file and the key.

The format is documented in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, get_args

from pipeline.core.config import CostUnit, read_toml
from pipeline.core.sim.device_curve import CostModel, DeviceCurve
from pipeline.core.sim.fleetspec import parse_fleet
from pipeline.core.sim.scenario import Burst, LengthDist, Phase, Scenario, ScenarioError, Topology


def number(
    where: str,
    table: dict[str, Any],
    key: str,
    *,
    default: float | None = None,
    positive: bool = False,
    minimum: float | None = None,
) -> float:
    if key not in table:
        if default is None:
            raise ScenarioError(f"{where}: missing key {key!r}")
        return default
    v = table[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ScenarioError(f"{where}.{key}: expected a number, got {v!r}")
    if positive and v <= 0:
        raise ScenarioError(f"{where}.{key}: must be > 0 (got {v})")
    if minimum is not None and v < minimum:
        raise ScenarioError(f"{where}.{key}: must be >= {minimum} (got {v})")
    return float(v)


def check_keys(where: str, table: dict[str, Any], known: set[str]) -> None:
    if not isinstance(table, dict):
        raise ScenarioError(f"{where}: expected a table, got {table!r}")
    for key in table:
        if key not in known:
            raise ScenarioError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")


def parse_curve(where: str, table: dict[str, Any]) -> DeviceCurve:
    if "points" in table:
        raw = table["points"]
        try:
            pts = tuple(sorted((float(b), float(ms)) for b, ms in raw))
        except (TypeError, ValueError):
            raise ScenarioError(f"{where}.points: expected [[batch, ms], ...], got {raw!r}") from None
        if len(pts) < 2:
            raise ScenarioError(f"{where}.points: need at least two measured points")
        if any(b <= 0 or ms <= 0 for b, ms in pts):
            raise ScenarioError(f"{where}.points: batch sizes and times must be > 0")
        if len({b for b, _ in pts}) != len(pts):
            raise ScenarioError(f"{where}.points: a batch size is listed twice")
        if "a_ms" in table or "c_ms" in table:
            raise ScenarioError(f"{where}: give either points or a_ms/c_ms, not both")
        return DeviceCurve(points=pts)
    a = number(where, table, "a_ms", minimum=0.0)
    c = number(where, table, "c_ms", minimum=0.0)
    if a + c <= 0:
        raise ScenarioError(f"{where}: a_ms + c_ms must be > 0 (a batch cannot be free)")
    return DeviceCurve(a_ms=a, c_ms=c)


def parse_dist(where: str, table: dict[str, Any]) -> LengthDist:
    check_keys(where, table, {"dist", "value", "min", "max", "median", "sigma"})
    kind = table.get("dist", "fixed")
    if kind == "fixed":
        return LengthDist("fixed", value=int(number(where, table, "value", minimum=0)))
    if kind == "uniform":
        lo, hi = int(number(where, table, "min", minimum=0)), int(number(where, table, "max", minimum=0))
        if hi < lo:
            raise ScenarioError(f"{where}: max ({hi}) is smaller than min ({lo})")
        return LengthDist("uniform", min=lo, max=hi)
    if kind == "lognormal":
        lo, hi = int(number(where, table, "min", default=1)), int(number(where, table, "max", minimum=1))
        return LengthDist(
            "lognormal",
            min=lo,
            max=hi,
            median=number(where, table, "median", positive=True),
            sigma=number(where, table, "sigma", minimum=0.0),
        )
    raise ScenarioError(f"{where}.dist: {kind!r} is not one of ['fixed', 'uniform', 'lognormal']")


def parse_cost(cost_raw: dict[str, Any], cw: str) -> CostModel:
    """A `[cost]` table: t(b) affine or from points, unit, optional shift and memory limit."""
    check_keys(cw, cost_raw, {"unit", "a_ms", "c_ms", "points", "shift_at_s", "shifted", "max_batch"})
    unit = cost_raw.get("unit", "requests")
    if unit not in get_args(CostUnit):
        raise ScenarioError(f"{cw}.unit: {unit!r} is not one of {list(get_args(CostUnit))}")
    base = parse_curve(cw, {k: v for k, v in cost_raw.items() if k in ("a_ms", "c_ms", "points")})
    shifted = None
    shift_at_ms = None
    if ("shift_at_s" in cost_raw) != ("shifted" in cost_raw):
        raise ScenarioError(f"{cw}: shift_at_s and [cost.shifted] go together (give both or neither)")
    if "shifted" in cost_raw:
        check_keys(f"{cw}.shifted", cost_raw["shifted"], {"a_ms", "c_ms", "points"})
        shifted = parse_curve(f"{cw}.shifted", cost_raw["shifted"])
        shift_at_ms = 1000.0 * number(cw, cost_raw, "shift_at_s", minimum=0.0)
    max_batch = None
    if "max_batch" in cost_raw:
        max_batch = int(number(cw, cost_raw, "max_batch", minimum=1))
    return CostModel(unit=unit, base=base, shifted=shifted, shift_at_ms=shift_at_ms, max_batch=max_batch)


def with_cost(scenario: Scenario, cost_table: dict[str, Any], source: str) -> Scenario:
    """The same arrivals on another device: `[cost]` replaced (a measured profile's)."""
    return dataclasses.replace(scenario, cost=parse_cost(cost_table, f"{source} [cost]"))


def parse_scenario(data: dict[str, Any], source: str = "<scenario>") -> Scenario:
    top = {
        "name",
        "description",
        "seed",
        "slo_p99_ms",
        "deadline_ms",
        "phases",
        "tokens",
        "cost",
        "topology",
        "priority",
        "profile_overrides",
        "fleet",
    }
    check_keys(source, data, top)
    if "profile_overrides" in data:
        raise ScenarioError(
            f"{source}: profile_overrides is not allowed: batchtide-default runs one default "
            "profile on every scenario (tune the batchtide family grid instead)"
        )
    name = data.get("name") or Path(source).stem
    phases_raw = data.get("phases")
    if not phases_raw:
        raise ScenarioError(f"{source}: needs at least one [[phases]] table")
    phases = []
    for i, ph in enumerate(phases_raw):
        where = f"{source} phases[{i}]"
        check_keys(where, ph, {"duration_s", "rate_per_s", "bursts"})
        bursts = None
        if "bursts" in ph:
            bw = f"{where}.bursts"
            check_keys(bw, ph["bursts"], {"every_s", "duration_s", "rate_per_s", "offset_s"})
            b = ph["bursts"]
            bursts = Burst(
                every_s=number(bw, b, "every_s", positive=True),
                duration_s=number(bw, b, "duration_s", positive=True),
                rate_per_s=number(bw, b, "rate_per_s", minimum=0.0),
                offset_s=number(bw, b, "offset_s", default=0.0, minimum=0.0),
            )
            if bursts.duration_s > bursts.every_s:
                raise ScenarioError(f"{bw}: duration_s ({bursts.duration_s}) is longer than every_s ({bursts.every_s})")
        phases.append(
            Phase(number(where, ph, "duration_s", positive=True), number(where, ph, "rate_per_s", minimum=0.0), bursts)
        )

    tokens = data.get("tokens", {})
    check_keys(f"{source} [tokens]", tokens, {"prompt", "output"})
    prompt = parse_dist(f"{source} [tokens.prompt]", tokens.get("prompt", {"dist": "fixed", "value": 32}))
    output = parse_dist(f"{source} [tokens.output]", tokens.get("output", {"dist": "fixed", "value": 0}))

    cost_raw = data.get("cost")
    if cost_raw is None:
        raise ScenarioError(f"{source}: missing [cost] table (a_ms/c_ms or points)")
    cost = parse_cost(cost_raw, f"{source} [cost]")

    topo_raw = data.get("topology", {})
    tw = f"{source} [topology]"
    check_keys(
        tw, topo_raw, {"mode", "consumers", "assignment", "skew", "fetch_delay_ms", "model_share", "model_cost_scale"}
    )
    mode = topo_raw.get("mode", "own-queues")
    if mode not in ("own-queues", "shared-queue", "shared-device"):
        raise ScenarioError(f"{tw}.mode: {mode!r} is not one of ['own-queues', 'shared-queue', 'shared-device']")
    consumers = int(number(tw, topo_raw, "consumers", default=1, minimum=1))
    assignment = topo_raw.get("assignment", "round-robin")
    if assignment not in ("round-robin", "random"):
        raise ScenarioError(f"{tw}.assignment: {assignment!r} is not one of ['round-robin', 'random']")
    share = tuple(float(x) for x in topo_raw.get("model_share", ()))
    scale = tuple(float(x) for x in topo_raw.get("model_cost_scale", ()))
    for key, vals in (("model_share", share), ("model_cost_scale", scale)):
        if vals and (mode != "shared-device" or len(vals) != consumers):
            raise ScenarioError(f"{tw}.{key}: only for mode 'shared-device', one value per model ({consumers} models)")
        if any(v <= 0 for v in vals):
            raise ScenarioError(f"{tw}.{key}: values must be > 0")
    skew = number(tw, topo_raw, "skew", default=0.0, minimum=0.0)
    delay = number(tw, topo_raw, "fetch_delay_ms", default=0.0, minimum=0.0)
    if (skew > 0 or delay > 0) and mode != "own-queues":
        raise ScenarioError(f"{tw}: skew and fetch_delay_ms need mode 'own-queues' (got {mode!r})")
    topology = Topology(mode, consumers, assignment, skew, delay, share, scale)

    prio_raw = data.get("priority", {})
    check_keys(f"{source} [priority]", prio_raw, {"mix"})
    mix = tuple(float(x) for x in prio_raw.get("mix", (1.0,)))
    if not mix or any(x < 0 for x in mix) or sum(mix) <= 0:
        raise ScenarioError(f"{source} [priority].mix: expected shares >= 0 per level, got {list(mix)}")

    seed = data.get("seed", 1)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ScenarioError(f"{source}.seed: expected a whole number >= 0, got {seed!r}")
    deadline = data.get("deadline_ms")
    if deadline is not None:
        deadline = number(source, data, "deadline_ms", positive=True)
    fleet = None
    if "fleet" in data:
        if mode != "own-queues" or skew > 0 or delay > 0 or "assignment" in topo_raw:
            raise ScenarioError(
                f"{tw}: a [fleet] scenario takes only 'consumers' here: mode "
                "own-queues, and [fleet] lays out partitions, keys and assignment"
            )
        duration_ms = 1000.0 * sum(p.duration_s for p in phases)
        fleet = parse_fleet(data["fleet"], f"{source} [fleet]", consumers, duration_ms, ScenarioError)
    return Scenario(
        name=str(name),
        phases=tuple(phases),
        cost=cost,
        seed=seed,
        description=str(data.get("description", "")),
        slo_p99_ms=number(source, data, "slo_p99_ms", default=1000.0, positive=True),
        prompt=prompt,
        output=output,
        topology=topology,
        priority_mix=mix,
        deadline_ms=deadline,
        fleet=fleet,
        source=source,
    )


def load_scenario(path: str | Path) -> Scenario:
    return parse_scenario(read_toml(path, ScenarioError, "scenario file"), str(Path(path)))
