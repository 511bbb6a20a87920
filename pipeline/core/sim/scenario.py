"""Scenario files (TOML) and the arrivals they generate.

A scenario says how requests arrive (Poisson phases with optional periodic
bursts), how long they are (prompt/output token distributions), what the
device costs (t(b)), how consumers and devices are laid out, the client
priority mix, and the SLO. It is validated on load: every error names the
file and the key. The format is documented in docs/benchmarks.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from pipeline.core.config import CostUnit, read_toml
from pipeline.core.sim.device import CostModel, DeviceCurve
from pipeline.core.sim.fleetspec import FleetSpec, parse_fleet, partition_owner

TopologyMode = Literal["own-queues", "shared-queue", "shared-device"]


class ScenarioError(ValueError):
    """A scenario file a user must fix; the message names the file and the key."""


@dataclass(frozen=True)
class Burst:
    every_s: float
    duration_s: float
    rate_per_s: float
    offset_s: float = 0.0


@dataclass(frozen=True)
class Phase:
    duration_s: float
    rate_per_s: float
    bursts: Burst | None = None


@dataclass(frozen=True)
class LengthDist:
    """Token count distribution: fixed, uniform [min, max] or lognormal (median, sigma) clipped."""

    dist: Literal["fixed", "uniform", "lognormal"] = "fixed"
    value: int = 0
    min: int = 0
    max: int = 0
    median: float = 0.0
    sigma: float = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(self.min, self.max + 1, size=n, dtype=np.int64)
        raw = rng.lognormal(np.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(raw), self.min, self.max).astype(np.int64)

    def mean(self) -> float:
        sample = self.sample(np.random.default_rng(0), 20000)
        return float(sample.mean())


@dataclass(frozen=True)
class Topology:
    mode: TopologyMode = "own-queues"
    consumers: int = 1
    """own-queues: consumers with one queue and one device each; shared-queue: devices
    behind one queue; shared-device: models (one queue each) sharing one device."""
    assignment: Literal["round-robin", "random"] = "round-robin"
    skew: float = 0.0
    """own-queues: consumer 0 gets (1 + skew) times the share of every other consumer."""
    fetch_delay_ms: float = 0.0
    """own-queues: consumer 0's records reach it this late (its partition lags)."""
    model_share: tuple[float, ...] = ()
    model_cost_scale: tuple[float, ...] = ()

    @property
    def lanes(self) -> int:
        """Number of queues (one policy object each)."""
        return 1 if self.mode == "shared-queue" else self.consumers

    @property
    def devices(self) -> int:
        return 1 if self.mode == "shared-device" else self.consumers

    def lane_devices(self, lane: int) -> list[int]:
        if self.mode == "own-queues":
            return [lane]
        if self.mode == "shared-queue":
            return list(range(self.consumers))
        return [0]

    def lane_cost_scale(self, lane: int) -> float:
        if self.mode == "shared-device" and self.model_cost_scale:
            return self.model_cost_scale[lane]
        return 1.0


@dataclass(frozen=True)
class Scenario:
    name: str
    phases: tuple[Phase, ...]
    cost: CostModel
    seed: int = 1
    description: str = ""
    slo_p99_ms: float = 1000.0
    prompt: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=32))
    output: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=0))
    topology: Topology = field(default_factory=Topology)
    priority_mix: tuple[float, ...] = (1.0,)
    deadline_ms: float | None = None
    fleet: FleetSpec | None = None
    """A consumer group studied by `bench fleet` (partitions, device speeds, forwarding)."""
    source: str = "<scenario>"

    @property
    def duration_ms(self) -> float:
        return 1000.0 * sum(p.duration_s for p in self.phases)

    def segments(self) -> list[tuple[float, float, float]]:
        """(start_ms, end_ms, rate_per_s) pieces of constant nominal rate, bursts included."""
        out: list[tuple[float, float, float]] = []
        start = 0.0
        for ph in self.phases:
            end = start + ph.duration_s * 1000.0
            cuts: list[tuple[float, float]] = []
            if ph.bursts is not None:
                b = ph.bursts
                t = start + b.offset_s * 1000.0
                while t < end:
                    cuts.append((t, min(end, t + b.duration_s * 1000.0)))
                    t += b.every_s * 1000.0
            cursor = start
            for b0, b1 in cuts:
                if b0 > cursor:
                    out.append((cursor, b0, ph.rate_per_s))
                out.append((b0, b1, ph.bursts.rate_per_s))  # type: ignore[union-attr]
                cursor = b1
            if cursor < end:
                out.append((cursor, end, ph.rate_per_s))
            start = end
        return out

    @property
    def mean_rate_per_s(self) -> float:
        segs = self.segments()
        return sum((e - s) * r for s, e, r in segs) / max(1e-9, sum(e - s for s, e, _ in segs))

    def mean_tokens(self) -> float:
        return self.prompt.mean() + self.output.mean()


@dataclass
class Arrivals:
    """One load realisation of a scenario, ordered by delivery to the consumers."""

    create_ms: np.ndarray
    """Record timestamp: waiting is measured from here."""
    deliver_ms: np.ndarray
    """When the request reaches its consumer (create + fetch delay)."""
    tokens: np.ndarray
    priority: np.ndarray
    lane: np.ndarray

    def __len__(self) -> int:
        return int(self.create_ms.shape[0])


class RateProfile:
    """Nominal arrival rate at a time, to split batches into busy and idle periods."""

    def __init__(self, scenario: Scenario) -> None:
        segs = scenario.segments()
        self._starts = [s for s, _, _ in segs]
        self._rates = [r for _, _, r in segs]
        self.mean = scenario.mean_rate_per_s

    def at(self, t_ms: float) -> float:
        i = bisect.bisect_right(self._starts, t_ms) - 1
        return self._rates[max(0, min(i, len(self._rates) - 1))]


DRAW_BLOCK = 4096
"""Per-request draws come in blocks of this many, each block from its own seeded
generator, so request i's draw does not depend on how many requests there are."""

ARRIVAL_STREAM, PROMPT_STREAM, OUTPUT_STREAM, PRIORITY_STREAM, LANE_STREAM = range(5)
"""One independent stream of draws per per-request quantity."""


def _stream_draws(seed: int, stream: int, n: int, draw: Any) -> np.ndarray:
    """Draws 0..n-1 of one stream: `draw(rng, size)` per block."""
    blocks = [draw(np.random.default_rng([seed, stream, b]), DRAW_BLOCK)
              for b in range(-(-n // DRAW_BLOCK))]
    return np.concatenate(blocks)[:n] if blocks else draw(np.random.default_rng(0), 0)


def _categorical(seed: int, stream: int, n: int, weights: np.ndarray) -> np.ndarray:
    """Draws 0..n-1 of one stream of indexes into `weights` (not normalised)."""
    p = weights / weights.sum()
    return _stream_draws(seed, stream, n, lambda g, k: g.choice(len(p), size=k, p=p))


def _arrival_times(scenario: Scenario, multiplier: float) -> np.ndarray:
    """Poisson arrival times at `multiplier` x the nominal rate, by time change: unit-rate
    points on the axis of expected requests (one stream for every load), divided by the
    multiplier and mapped back through the nominal intensity's cumulative curve."""
    segs = [(s, e, r) for s, e, r in scenario.segments() if r > 0 and e > s]
    if not segs or multiplier <= 0:
        return np.zeros(0)
    expected = np.cumsum([0.0] + [(e - s) * r / 1000.0 for s, e, r in segs])
    reach = expected[-1] * multiplier
    n = int(reach + 8 * math.sqrt(reach)) + 16
    while True:
        points = np.cumsum(_stream_draws(scenario.seed, ARRIVAL_STREAM, n, lambda g, k: g.standard_exponential(k)))
        if points[-1] >= reach:
            break
        n *= 2
    x = points[points < reach] / multiplier
    seg = np.searchsorted(expected, x, side="right") - 1
    starts = np.array([s for s, _, _ in segs])
    rates = np.array([r for _, _, r in segs])
    return starts[seg] + (x - expected[seg]) * 1000.0 / rates[seg]


def make_arrivals(scenario: Scenario, multiplier: float = 1.0) -> Arrivals:
    """Poisson arrivals at `multiplier` x every rate, from one realisation for every load
    (common random numbers): request i keeps its tokens, priority and lane at any
    multiplier and arrives earlier as the load grows. A heavier load is the same traffic,
    denser, so comparing two loads compares loads, not two draws: on a short scenario
    independent draws made pass/fail at neighbouring loads a coin toss."""
    create = _arrival_times(scenario, multiplier)
    n = create.shape[0]
    seed = scenario.seed
    tokens = (_stream_draws(seed, PROMPT_STREAM, n, scenario.prompt.sample)
              + _stream_draws(seed, OUTPUT_STREAM, n, scenario.output.sample))
    mix = np.asarray(scenario.priority_mix, dtype=float)
    priority = _categorical(seed, PRIORITY_STREAM, n, mix) if len(mix) > 1 else np.zeros(n, dtype=np.int64)
    topo = scenario.topology
    lanes = topo.lanes
    if scenario.fleet is not None:
        fleet = scenario.fleet
        partition = _categorical(seed, LANE_STREAM, n, fleet.partition_weights())
        lane = partition_owner(fleet, topo.consumers)[partition]
    elif lanes == 1:
        lane = np.zeros(n, dtype=np.int64)
    elif topo.mode == "shared-device":
        share = np.asarray(topo.model_share or [1.0] * lanes, dtype=float)
        lane = _categorical(seed, LANE_STREAM, n, share)
    else:
        weights = np.ones(lanes)
        weights[0] += topo.skew
        if topo.assignment == "random" or topo.skew > 0:
            lane = _categorical(seed, LANE_STREAM, n, weights)
        else:
            lane = np.arange(n, dtype=np.int64) % lanes
    deliver = create.copy()
    if topo.fetch_delay_ms > 0 and topo.mode == "own-queues":
        deliver[lane == 0] += topo.fetch_delay_ms
    order = np.argsort(deliver, kind="stable")
    return Arrivals(create[order], deliver[order], tokens[order], priority[order], lane[order])


# ---- loading and validation ------------------------------------------------------------


def _number(where: str, table: dict[str, Any], key: str, *, default: float | None = None,
            positive: bool = False, minimum: float | None = None) -> float:
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


def _check_keys(where: str, table: dict[str, Any], known: set[str]) -> None:
    if not isinstance(table, dict):
        raise ScenarioError(f"{where}: expected a table, got {table!r}")
    for key in table:
        if key not in known:
            raise ScenarioError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")


def _curve(where: str, table: dict[str, Any]) -> DeviceCurve:
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
    a = _number(where, table, "a_ms", minimum=0.0)
    c = _number(where, table, "c_ms", minimum=0.0)
    if a + c <= 0:
        raise ScenarioError(f"{where}: a_ms + c_ms must be > 0 (a batch cannot be free)")
    return DeviceCurve(a_ms=a, c_ms=c)


def _dist(where: str, table: dict[str, Any]) -> LengthDist:
    _check_keys(where, table, {"dist", "value", "min", "max", "median", "sigma"})
    kind = table.get("dist", "fixed")
    if kind == "fixed":
        return LengthDist("fixed", value=int(_number(where, table, "value", minimum=0)))
    if kind == "uniform":
        lo, hi = int(_number(where, table, "min", minimum=0)), int(_number(where, table, "max", minimum=0))
        if hi < lo:
            raise ScenarioError(f"{where}: max ({hi}) is smaller than min ({lo})")
        return LengthDist("uniform", min=lo, max=hi)
    if kind == "lognormal":
        lo, hi = int(_number(where, table, "min", default=1)), int(_number(where, table, "max", minimum=1))
        return LengthDist("lognormal", min=lo, max=hi,
                          median=_number(where, table, "median", positive=True),
                          sigma=_number(where, table, "sigma", minimum=0.0))
    raise ScenarioError(f"{where}.dist: {kind!r} is not one of ['fixed', 'uniform', 'lognormal']")


def parse_cost(cost_raw: dict[str, Any], cw: str) -> CostModel:
    """A `[cost]` table: t(b) affine or from points, unit, optional shift and memory limit."""
    _check_keys(cw, cost_raw, {"unit", "a_ms", "c_ms", "points", "shift_at_s", "shifted", "max_batch"})
    unit = cost_raw.get("unit", "requests")
    if unit not in get_args(CostUnit):
        raise ScenarioError(f"{cw}.unit: {unit!r} is not one of {list(get_args(CostUnit))}")
    base = _curve(cw, {k: v for k, v in cost_raw.items() if k in ("a_ms", "c_ms", "points")})
    shifted = None
    shift_at_ms = None
    if ("shift_at_s" in cost_raw) != ("shifted" in cost_raw):
        raise ScenarioError(f"{cw}: shift_at_s and [cost.shifted] go together (give both or neither)")
    if "shifted" in cost_raw:
        _check_keys(f"{cw}.shifted", cost_raw["shifted"], {"a_ms", "c_ms", "points"})
        shifted = _curve(f"{cw}.shifted", cost_raw["shifted"])
        shift_at_ms = 1000.0 * _number(cw, cost_raw, "shift_at_s", minimum=0.0)
    max_batch = None
    if "max_batch" in cost_raw:
        max_batch = int(_number(cw, cost_raw, "max_batch", minimum=1))
    return CostModel(unit=unit, base=base, shifted=shifted, shift_at_ms=shift_at_ms, max_batch=max_batch)


def with_cost(scenario: Scenario, cost_table: dict[str, Any], source: str) -> Scenario:
    """The same arrivals on another device: `[cost]` replaced (a measured profile's)."""
    return dataclasses.replace(scenario, cost=parse_cost(cost_table, f"{source} [cost]"))


def parse_scenario(data: dict[str, Any], source: str = "<scenario>") -> Scenario:
    top = {"name", "description", "seed", "slo_p99_ms", "deadline_ms", "phases", "tokens",
           "cost", "topology", "priority", "profile_overrides", "fleet"}
    _check_keys(source, data, top)
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
        _check_keys(where, ph, {"duration_s", "rate_per_s", "bursts"})
        bursts = None
        if "bursts" in ph:
            bw = f"{where}.bursts"
            _check_keys(bw, ph["bursts"], {"every_s", "duration_s", "rate_per_s", "offset_s"})
            b = ph["bursts"]
            bursts = Burst(
                every_s=_number(bw, b, "every_s", positive=True),
                duration_s=_number(bw, b, "duration_s", positive=True),
                rate_per_s=_number(bw, b, "rate_per_s", minimum=0.0),
                offset_s=_number(bw, b, "offset_s", default=0.0, minimum=0.0),
            )
            if bursts.duration_s > bursts.every_s:
                raise ScenarioError(
                    f"{bw}: duration_s ({bursts.duration_s}) is longer than every_s ({bursts.every_s})"
                )
        phases.append(Phase(_number(where, ph, "duration_s", positive=True),
                            _number(where, ph, "rate_per_s", minimum=0.0), bursts))

    tokens = data.get("tokens", {})
    _check_keys(f"{source} [tokens]", tokens, {"prompt", "output"})
    prompt = _dist(f"{source} [tokens.prompt]", tokens.get("prompt", {"dist": "fixed", "value": 32}))
    output = _dist(f"{source} [tokens.output]", tokens.get("output", {"dist": "fixed", "value": 0}))

    cost_raw = data.get("cost")
    if cost_raw is None:
        raise ScenarioError(f"{source}: missing [cost] table (a_ms/c_ms or points)")
    cost = parse_cost(cost_raw, f"{source} [cost]")

    topo_raw = data.get("topology", {})
    tw = f"{source} [topology]"
    _check_keys(tw, topo_raw, {"mode", "consumers", "assignment", "skew", "fetch_delay_ms",
                               "model_share", "model_cost_scale"})
    mode = topo_raw.get("mode", "own-queues")
    if mode not in ("own-queues", "shared-queue", "shared-device"):
        raise ScenarioError(f"{tw}.mode: {mode!r} is not one of ['own-queues', 'shared-queue', 'shared-device']")
    consumers = int(_number(tw, topo_raw, "consumers", default=1, minimum=1))
    assignment = topo_raw.get("assignment", "round-robin")
    if assignment not in ("round-robin", "random"):
        raise ScenarioError(f"{tw}.assignment: {assignment!r} is not one of ['round-robin', 'random']")
    share = tuple(float(x) for x in topo_raw.get("model_share", ()))
    scale = tuple(float(x) for x in topo_raw.get("model_cost_scale", ()))
    for key, vals in (("model_share", share), ("model_cost_scale", scale)):
        if vals and (mode != "shared-device" or len(vals) != consumers):
            raise ScenarioError(
                f"{tw}.{key}: only for mode 'shared-device', one value per model ({consumers} models)"
            )
        if any(v <= 0 for v in vals):
            raise ScenarioError(f"{tw}.{key}: values must be > 0")
    skew = _number(tw, topo_raw, "skew", default=0.0, minimum=0.0)
    delay = _number(tw, topo_raw, "fetch_delay_ms", default=0.0, minimum=0.0)
    if (skew > 0 or delay > 0) and mode != "own-queues":
        raise ScenarioError(f"{tw}: skew and fetch_delay_ms need mode 'own-queues' (got {mode!r})")
    topology = Topology(mode, consumers, assignment, skew, delay, share, scale)

    prio_raw = data.get("priority", {})
    _check_keys(f"{source} [priority]", prio_raw, {"mix"})
    mix = tuple(float(x) for x in prio_raw.get("mix", (1.0,)))
    if not mix or any(x < 0 for x in mix) or sum(mix) <= 0:
        raise ScenarioError(f"{source} [priority].mix: expected shares >= 0 per level, got {list(mix)}")

    seed = data.get("seed", 1)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ScenarioError(f"{source}.seed: expected a whole number >= 0, got {seed!r}")
    deadline = data.get("deadline_ms")
    if deadline is not None:
        deadline = _number(source, data, "deadline_ms", positive=True)
    fleet = None
    if "fleet" in data:
        if mode != "own-queues" or skew > 0 or delay > 0 or "assignment" in topo_raw:
            raise ScenarioError(f"{tw}: a [fleet] scenario takes only 'consumers' here: mode "
                                "own-queues, and [fleet] lays out partitions, keys and assignment")
        duration_ms = 1000.0 * sum(p.duration_s for p in phases)
        fleet = parse_fleet(data["fleet"], f"{source} [fleet]", consumers, duration_ms, ScenarioError)
    return Scenario(
        name=str(name), phases=tuple(phases), cost=cost, seed=seed,
        description=str(data.get("description", "")),
        slo_p99_ms=_number(source, data, "slo_p99_ms", default=1000.0, positive=True),
        prompt=prompt, output=output, topology=topology, priority_mix=mix,
        deadline_ms=deadline, fleet=fleet, source=source,
    )


def load_scenario(path: str | Path) -> Scenario:
    return parse_scenario(read_toml(path, ScenarioError, "scenario file"), str(Path(path)))
