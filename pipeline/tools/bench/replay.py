"""Replay recorded traffic through the simulator: predict each candidate profile on the
arrivals that really came, and check the prediction against what was recorded.

Nothing here is generated: the arrivals are the recorded record times, tokens,
priorities and serving consumers (one queue per consumer, as the group had),
each reaching its consumer after its recorded fetch lag (broker and fetch
time; under backpressure also the pauses the profile that ran caused);
the device's t(b) is the median recorded compute time per batch size (per
cost when the unit is tokens), and the device runs at the recorded speed
moment by moment (pipeline/core/sim/timeline.py): a batch replayed at time t
takes the speed of a recorded batch dispatched near t, is held for that
batch's dispatch-to-start gap and answers after its publish gap, so a
prediction and a recording compare end to end. The draws are seeded and each
candidate is replayed `replays` times (the figures are the medians). A window
whose answers carry no compute stamps adds the median of e2e - wait - compute
to every predicted latency instead of the gaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pipeline.core.config import BatchProfile
from pipeline.core.engine import BatchingEngine
from pipeline.core.sim.arrivals import Arrivals
from pipeline.core.sim.device_curve import CostModel, DeviceCurve
from pipeline.core.sim.metrics import RunMetrics, measure
from pipeline.core.sim.scenario import LengthDist, Phase, Scenario, Topology
from pipeline.core.sim.simulator import simulate
from pipeline.core.sim.timeline import LaneStamps, Timeline, lane_stamps, speed_curve
from pipeline.core.store.traffic import RecordedTraffic

VALIDATE_TOLERANCE = 0.15
"""--validate: predicted p99 and throughput must each be within this share of the recording."""
SEGMENT_MS = 1000.0
REPLAYS = 9
"""Replays per candidate (seeded draws from the recorded timeline); the prediction is their median."""


class ReplayError(ValueError):
    """The window holds nothing to replay (no requests, or no batches to learn t(b) from)."""


@dataclass(frozen=True)
class Recorded:
    """What the window measured, end to end."""

    requests: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    throughput_rps: float
    marked_share: float
    overhead_ms: float
    """Median e2e - wait - compute: the hops the simulator does not model (generation: e2e - the
    last token's time)."""
    ttft_p99_ms: float = math.nan
    """Generation: time to first token and time per output token, p99 of the answers."""
    tpot_p99_ms: float = math.nan
    device_scale: float | None = None
    """Generation: how much slower than profiled the device ran in the window (its curves' factor)."""
    step_overhead_ms: float | None = None
    """Generation: the fixed ms each decode step paid in the window beyond the scaled curves."""
    join_pace_rps: float = math.nan
    """Generation: requests per second the decode loop admitted while joiners waited (NaN: none waited)."""
    ride_ms_per_token: float | None = None
    """Generation: ms per ridden prompt token (before the device factor) that replays that pace."""


@dataclass(frozen=True)
class Prediction:
    name: str
    profile: BatchProfile
    p50_ms: float
    p99_ms: float
    p999_ms: float
    throughput_rps: float
    hit_ratio: float
    expired_share: float
    marked_share: float
    mean_batch: float
    ttft_p99_ms: float = math.nan
    tpot_p99_ms: float = math.nan
    mean_rows: float = math.nan
    """Generation: mean rows in the running set per decode step."""


@dataclass
class Replay:
    scenario: Scenario | None
    """None for a generating model's window (replay_generation.py): not exportable yet."""
    arrivals: Arrivals | None
    recorded: Recorded
    predictions: list[Prediction]
    parts: tuple[str, ...] = ()
    """What the replay added to the median t(b) from the recording (device speed, start gap,
    publish gap); empty for a generating model's replay."""
    replays: int = 1

    @property
    def ran(self) -> Prediction:
        return self.predictions[0]

    def recommended(self) -> Prediction:
        """Lowest predicted p99 among the candidates that lose no throughput, and of those the ones
        that expire the least. In that order, since no candidate need be best on both: on a generation
        window the 10 s step budget turns the time-per-token objective off, so it expires none but may
        serve slower than the profile that ran. A figure that is NaN counts as the worst."""

        def rate(p: Prediction) -> float:
            return p.throughput_rps if not math.isnan(p.throughput_rps) else -math.inf

        def expired(p: Prediction) -> float:
            return p.expired_share if not math.isnan(p.expired_share) else math.inf

        best_rate = max(rate(p) for p in self.predictions)
        fast = [p for p in self.predictions if rate(p) >= 0.99 * best_rate]
        least_expired = min(expired(p) for p in fast)
        fine = [p for p in fast if expired(p) <= least_expired + 0.001]
        return min(fine, key=lambda p: (p.p99_ms if not math.isnan(p.p99_ms) else math.inf, self.predictions.index(p)))

    def validation(self) -> dict[str, float]:
        """Predicted / recorded for the profile that ran."""
        rec, ran = self.recorded, self.ran
        return {
            "p99_ratio": ran.p99_ms / rec.p99_ms if rec.p99_ms > 0 else math.inf,
            "throughput_ratio": ran.throughput_rps / rec.throughput_rps if rec.throughput_rps > 0 else math.inf,
        }

    def validates(self) -> bool:
        return all(abs(v - 1.0) <= VALIDATE_TOLERANCE for v in self.validation().values())


def cost_points(traffic: RecordedTraffic, unit: str) -> tuple[tuple[float, float], ...]:
    """Median compute time per recorded batch size (or cost, in tokens)."""
    x = traffic.batch_cost if unit == "tokens" else traffic.batch_size
    ok = (x > 0) & (traffic.batch_compute_ms > 0)
    x, t = x[ok], traffic.batch_compute_ms[ok]
    if x.size == 0:
        raise ReplayError("no batches recorded in this window: t(b) cannot be learned")
    return tuple((float(s), float(np.median(t[x == s]))) for s in np.unique(x))


@dataclass(frozen=True)
class RecordedCost(CostModel):
    """t(b) as recorded, spread included: the k-th batch of a recorded size takes the
    k-th recorded compute time of that size (cycling), so a loaded host's slow batches
    are replayed, not smoothed into a median; other sizes take the median curve."""

    recorded: dict[float, list[float]] = field(default_factory=dict)
    used: dict[float, int] = field(default_factory=dict)

    def batch_ms(self, size: int, tokens: int, now_ms: float, scale: float = 1.0) -> float:
        x = float(tokens if self.unit == "tokens" else size)
        times = self.recorded.get(x)
        if not times:
            return super().batch_ms(size, tokens, now_ms, scale)
        k = self.used.get(x, 0)
        self.used[x] = k + 1
        return scale * times[k % len(times)]


def _segments(create_ms: np.ndarray, span_ms: float) -> tuple[Phase, ...]:
    """Arrival rate per second of the window (the busy/idle split and --export use it)."""
    edges = np.arange(0.0, span_ms + SEGMENT_MS, SEGMENT_MS)
    counts, _ = np.histogram(create_ms, bins=edges)
    return tuple(Phase(SEGMENT_MS / 1000.0, float(c) * 1000.0 / SEGMENT_MS) for c in counts)


def traffic_scenario(
    traffic: RecordedTraffic, profile: BatchProfile, device_cap: int | None = None
) -> tuple[Scenario, Arrivals]:
    if len(traffic) == 0:
        raise ReplayError(f"no requests of model {traffic.model!r} recorded in this window")
    t0 = float(traffic.enqueue_ms.min())
    create = traffic.enqueue_ms - t0
    span = float(create.max()) + 1.0
    levels = int(traffic.priority.max()) + 1
    mix = tuple(float((traffic.priority == level).sum()) for level in range(levels))
    pts = cost_points(traffic, profile.cost_unit)
    curve = DeviceCurve(points=pts) if len(pts) > 1 else DeviceCurve(a_ms=0.0, c_ms=pts[0][1] / pts[0][0])
    unit = profile.cost_unit
    x = traffic.batch_cost if unit == "tokens" else traffic.batch_size
    timed = traffic.batch_compute_ms > 0
    recorded = {float(v): traffic.batch_compute_ms[(x == v) & timed].tolist() for v in np.unique(x[timed])}
    cost = RecordedCost(unit=unit, base=curve, max_batch=device_cap if unit == "requests" else None, recorded=recorded)
    tokens = traffic.tokens
    scenario = Scenario(
        name=f"replay-{traffic.model}",
        phases=_segments(create, span),
        cost=cost,
        description=f"recorded traffic of {traffic.model}: {len(traffic)} requests",
        slo_p99_ms=profile.slo_p99_ms,
        prompt=LengthDist(
            "lognormal",
            min=int(max(1, tokens.min())),
            max=int(max(1, tokens.max())),
            median=float(max(1.0, np.median(tokens))),
            sigma=float(np.std(np.log(np.maximum(tokens, 1)))),
        ),
        topology=Topology(mode="own-queues", consumers=max(1, len(traffic.consumers))),
        priority_mix=mix if sum(mix) > 0 else (1.0,),
        deadline_ms=profile.default_deadline_ms,
        source="<clickhouse>",
    )
    deliver = create + traffic.fetch_lag_ms
    order = np.argsort(deliver, kind="stable")
    arrivals = Arrivals(create[order], deliver[order], tokens[order], traffic.priority[order], traffic.consumer[order])
    return scenario, arrivals


def recorded_figures(traffic: RecordedTraffic) -> Recorded:
    served = traffic.outcome == "ok"
    e2e = traffic.e2e_ms[served]
    if e2e.size == 0:
        raise ReplayError("no request of this window was served (outcome ok)")
    span_s = max(1e-9, (float(traffic.produce_ms[served].max()) - float(traffic.enqueue_ms.min())) / 1000.0)
    hops = traffic.e2e_ms[served] - traffic.wait_ms[served] - traffic.compute_ms[served]
    return Recorded(
        requests=len(traffic),
        p50_ms=float(np.percentile(e2e, 50)),
        p99_ms=float(np.percentile(e2e, 99)),
        p999_ms=float(np.percentile(e2e, 99.9)),
        throughput_rps=float(served.sum()) / span_s,
        marked_share=float(traffic.marked.mean()),
        overhead_ms=max(0.0, float(np.median(hops))),
    )


def candidates(ran: BatchProfile) -> list[tuple[str, BatchProfile]]:
    """The profile that ran first, then a small grid around it: the auto default, caps,
    windows and marking off."""
    out: list[tuple[str, BatchProfile]] = [("ran", ran)]
    auto = ran.replace(hard_cap="auto", target_size="auto")
    out.append(("auto cap", auto))
    for cap in (16, 32, 64, 128):
        out.append((f"hard_cap {cap}", ran.replace(hard_cap=cap, target_size="auto")))
    for wait in (2.0, 50.0):
        if wait != ran.max_wait_ms:
            out.append((f"max_wait {wait:g} ms", ran.replace(max_wait_ms=wait, min_wait_ms=min(ran.min_wait_ms, wait))))
    if ran.tail_marking:
        out.append(("marking off", ran.replace(tail_mark_ratio=0.0)))
    seen: set[BatchProfile] = set()
    unique = []
    for name, profile in out:
        if profile not in seen:
            seen.add(profile)
            unique.append((name, profile))
    return unique


def traffic_timeline(traffic: RecordedTraffic, scenario: Scenario) -> Timeline | None:
    """The recorded device's speed and gaps per consumer over the window (None: no batch stamps)."""
    if traffic.batch_dispatch_ms.size == 0:
        return None
    t0 = float(traffic.enqueue_ms.min())
    unit = scenario.cost.unit
    x = (traffic.batch_cost if unit == "tokens" else traffic.batch_size).astype(float)
    start, publish = traffic.batch_start_gap_ms, traffic.batch_publish_gap_ms
    curve = speed_curve(x, traffic.batch_compute_ms) or scenario.cost.base
    lanes: list[LaneStamps] = []
    for lane in range(scenario.topology.lanes):
        mine = traffic.batch_consumer == lane
        lanes.append(
            lane_stamps(
                curve,
                x[mine],
                traffic.batch_dispatch_ms[mine] - t0,
                traffic.batch_compute_ms[mine],
                start[mine],
                publish[mine],
            )
        )
    stamped = traffic.stamped
    return Timeline(curve, unit, lanes, start_gap=stamped, publish_gap=stamped)


def _run(
    profile: BatchProfile,
    scenario: Scenario,
    arrivals: Arrivals,
    device_cap: int | None,
    prior: list[tuple[int, float]],
    timeline: Timeline | None,
) -> RunMetrics:
    if isinstance(scenario.cost, RecordedCost):
        scenario.cost.used.clear()
    lanes = scenario.topology.lanes
    engines = [BatchingEngine(profile, device_cap=device_cap, prior_costs=prior) for _ in range(lanes)]
    return measure(scenario, simulate(scenario, arrivals, engines, timeline=timeline))


def _predict(
    name: str,
    profile: BatchProfile,
    scenario: Scenario,
    arrivals: Arrivals,
    device_cap: int | None,
    prior: list[tuple[int, float]],
    overhead_ms: float,
    timeline: Timeline | None,
    replays: int,
) -> Prediction:
    runs = [
        _run(profile, scenario, arrivals, device_cap, prior, timeline.reseeded(seed) if timeline else None)
        for seed in range(replays if timeline is not None else 1)
    ]

    def median(field_: str) -> float:
        return float(np.median([getattr(m, field_) for m in runs]))

    return Prediction(
        name=name,
        profile=profile,
        p50_ms=median("p50_ms") + overhead_ms,
        p99_ms=median("p99_ms") + overhead_ms,
        p999_ms=median("p999_ms") + overhead_ms,
        throughput_rps=median("throughput_rps"),
        hit_ratio=median("hit_ratio"),
        expired_share=median("expired_share"),
        marked_share=median("marked_share"),
        mean_batch=median("mean_batch_size"),
    )


def replay(
    traffic: RecordedTraffic,
    ran: BatchProfile,
    *,
    device_cap: int | None = None,
    prior_costs: list[tuple[int, float]] | None = None,
    replays: int = REPLAYS,
    timeline: bool = True,
) -> Replay:
    """Predict the profile that ran and the candidate grid on the recorded arrivals.

    `device_cap` and `prior_costs` come from the device profile file the consumer
    loaded, when there was one (the engines start as the live one did). `timeline`
    False replays the recorded times per size in order, as before the stamps were read."""
    if replays < 1:
        raise ValueError(f"replays must be >= 1 (got {replays})")
    scenario, arrivals = traffic_scenario(traffic, ran, device_cap)
    recorded = recorded_figures(traffic)
    prior = list(prior_costs or [])
    line = traffic_timeline(traffic, scenario) if timeline else None
    parts = line.parts if line is not None else ()
    # the gaps, when stamped, are in the timeline; else the window's median of both is added
    overhead = 0.0 if line is not None and line.start_gap else recorded.overhead_ms
    predictions = [
        _predict(name, profile, scenario, arrivals, device_cap, prior, overhead, line, replays)
        for name, profile in candidates(ran)
    ]
    return Replay(scenario, arrivals, recorded, predictions, parts=parts, replays=replays if line is not None else 1)


def scenario_toml(replay_: Replay) -> str:
    """The window as a scenario file: per-second rates, token mix, measured t(b), consumers."""
    s = replay_.scenario
    if s is None:
        raise ReplayError("a generating model's window cannot be exported as a scenario yet")
    lines = [
        f"# Exported by `batchtide replay` from {s.description}.",
        f'name = "{s.name}"',
        f'description = "{s.description}"',
        f"slo_p99_ms = {s.slo_p99_ms:g}",
    ]
    if s.deadline_ms is not None:
        lines.append(f"deadline_ms = {s.deadline_ms:g}")
    for phase in s.phases:
        lines += ["", "[[phases]]", f"duration_s = {phase.duration_s:g}", f"rate_per_s = {phase.rate_per_s:g}"]
    p = s.prompt
    lines += [
        "",
        "[tokens]",
        f'prompt = {{ dist = "lognormal", median = {p.median:g}, sigma = {p.sigma:.3f}, '
        f"min = {p.min}, max = {p.max} }}",
        'output = { dist = "fixed", value = 0 }',
        "",
        "[cost]",
        f'unit = "{s.cost.unit}"',
        "points = [" + ", ".join(f"[{b:g}, {ms:.3f}]" for b, ms in s.cost.base.points) + "]",
    ]
    if s.cost.max_batch is not None:
        lines.append(f"max_batch = {s.cost.max_batch}")
    lines += ["", "[topology]", 'mode = "own-queues"', f"consumers = {s.topology.consumers}", 'assignment = "random"']
    if len(s.priority_mix) > 1:
        lines += ["", "[priority]", "mix = [" + ", ".join(f"{x:g}" for x in s.priority_mix) + "]"]
    return "\n".join(lines) + "\n"
