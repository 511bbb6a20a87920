"""Replay of a generating model's recorded traffic: the decode loop, not static batches.

A generating model served with `batching = "iteration"` keeps several batches in flight and
one running set on the device; each recorded batch's compute time is its requests' stay in
that set, shared with the others, so replaying batches one after another for their recorded
times (replay.py's request path) charges the device many times over (x233 on p99). Here the
recorded arrivals (record time, fetch lag, prompt and answer tokens, priority, consumer) go
through the generation simulator (pipeline/core/sim/generation/decode_loop.py): the engine that ran, the
decode loop's join rule, its KV token cap and step budget, and the device's prefill and
decode-step curves from the profile file the consumer loaded.

The device during the recording is not the device when it was profiled: on a shared machine
the consumer's steps ran slower (other processes held the cores), and a live loop pays per step
what a profile measured alone does not (its thread shares the interpreter with the consumer's
event loop). The recording measures both: each answer's time per output token, and the pace
the loop admitted waiting joiners at. The replay (`calibrate_device`) scales the profile's
curves by the factor that makes the simulated median time per output token the recorded one
(`device_scale`, found by bisection), adds the fixed cost per step that brings every answer's
simulated time per token closest to its recorded one, and, where joiners queued, charges a
prompt token riding a step what makes the simulated loop admit them at the recorded pace
(`recorded_join_pace`): a saturated loop serves at that pace. With `calibrate=False` the
profile's curves are used as measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipeline.core.config import BatchProfile, ModelConfig
from pipeline.core.engine import BatchingEngine
from pipeline.core.profile_file import DeviceProfile, longest_request
from pipeline.core.sim.generation.cost import GenerationCost
from pipeline.core.sim.generation.decode_loop import (
    GenArrivals,
    GenOutcome,
    LoopSettings,
    running_token_cap,
    simulate_generation,
)
from pipeline.core.sim.generation.figures import gen_figures
from pipeline.core.store.traffic import RecordedTraffic
from pipeline.tools.bench.replay import Prediction, Replay, ReplayError, recorded_figures

CALIBRATION_PASSES = 8
"""Bisection steps spent finding the device's speed during the recording (to within ~0.3%)."""
MAX_SCALE = 64.0
"""The slowest (and, inverted, fastest) the device may have run against its profile."""
OVERHEAD_STEP = 0.1
OVERHEAD_SHARES = tuple(k * OVERHEAD_STEP for k in range(10))
"""Fixed costs per decode step tried, as shares of the recorded median time per output token (then
half a step either side of the best)."""
RIDE_RANGE = 8.0
"""The ride cost per token is looked for within this factor of the profile's prefill slope."""
PACE_TOLERANCE = 0.05
"""A simulated join pace this close to the recorded one keeps the profile's ride cost."""
MISFIT_TIE = 0.001
"""A larger fixed cost must fit the answers' times per token this much better (mean |log| ratio)."""


class GenerationReplayError(ReplayError):
    """The window or the profile cannot be replayed as generation (the message says why)."""


@dataclass(frozen=True)
class GenSetup:
    """What the consumer ran with: its model config and the device profile it loaded."""

    model: ModelConfig
    device: DeviceProfile

    def engine(self, profile: BatchProfile) -> BatchingEngine:
        """The engine as the consumer builds it (profile_file.apply for iteration-level batching)."""
        recommended = self.device.recommended.get("hard_cap")
        limit = max(int(recommended), longest_request(self.model)) if recommended else longest_request(self.model)
        points = [(size, ms) for size, ms in self.device.cost_points() if size <= limit]
        if profile.compute_budget_ms is None and profile.slo_ms_per_new_token:
            profile = profile.replace(compute_budget_ms=profile.budget_ms(self.model.max_new_tokens))
        if self.model.batching == "iteration":
            profile = profile.replace(shed_when="never")  # the join rule decides (ModelConfig.engine_profile)
        return BatchingEngine(profile, device_cap=limit, prior_costs=points)

    def loop(self, profile: BatchProfile) -> LoopSettings:
        """The decode loop's bounds as the runner derives them (transformers_runner)."""
        cap = profile.hard_cap if profile.cost_unit == "tokens" and isinstance(profile.hard_cap, int) else None
        target = profile.target_size if isinstance(profile.target_size, int) else None
        budget = profile.slo_ms_per_new_token or profile.compute_budget_ms or profile.slo_p99_ms / 2.0
        return LoopSettings(
            token_cap=running_token_cap(cap, profile.max_inflight_batches, target),
            step_budget_ms=budget,
            reserve_tokens=self.model.max_new_tokens,
            tpot_ms=profile.slo_ms_per_new_token or None,
            step_token_budget=self.model.step_token_budget,
            ttft_ms=replace(self.model, profile=profile).ttft_objective_ms,
        )


def generation_arrivals(
    traffic: RecordedTraffic, model: ModelConfig, deadline_ms: float | None
) -> tuple[GenArrivals, np.ndarray]:
    """The recorded requests as the simulator takes them, in delivery order. A request emits its
    answer's tokens (an end-of-sequence token that stopped it early is not recorded: the step
    that produced it is not charged), and the delivery order (to index per-request arrays)."""
    t0 = float(traffic.enqueue_ms.min())
    create = traffic.enqueue_ms - t0
    deliver = create + traffic.fetch_lag_ms
    order = np.argsort(deliver, kind="stable")
    n = len(traffic)
    limit = np.full(n, model.max_new_tokens, dtype=np.int64)
    deadline = create + deadline_ms if deadline_ms is not None else np.full(n, np.nan)
    return GenArrivals(
        create_ms=create[order],
        deliver_ms=deliver[order],
        prompt=np.maximum(traffic.tokens_in, 1)[order],
        emits=np.maximum(traffic.tokens_out, 1)[order],
        limit=limit[order],
        priority=traffic.priority[order],
        lane=traffic.consumer[order],
        deadline_ms=deadline[order],
    ), order


def recorded_tpot(traffic: RecordedTraffic) -> np.ndarray:
    """Time per output token of each answer with two tokens or more (NaN otherwise)."""
    out = traffic.tokens_out.astype(float)
    ok = (traffic.outcome == "ok") & (out > 1) & (traffic.first_token_ms > 0)
    tpot = np.full(len(traffic), np.nan)
    tpot[ok] = (traffic.last_token_ms[ok] - traffic.first_token_ms[ok]) / (out[ok] - 1)
    return tpot


def recorded_ttft(traffic: RecordedTraffic) -> np.ndarray:
    ok = (traffic.outcome == "ok") & (traffic.first_token_ms > 0)
    ttft = np.full(len(traffic), np.nan)
    ttft[ok] = traffic.first_token_ms[ok] - traffic.enqueue_ms[ok]
    return ttft


def hops_ms(traffic: RecordedTraffic) -> float:
    """Median of e2e - (last token - record time): publishing the answer, outside the device loop."""
    ok = (traffic.outcome == "ok") & (traffic.last_token_ms > 0)
    if not ok.any():
        return 0.0
    return max(0.0, float(np.median(traffic.e2e_ms[ok] - (traffic.last_token_ms[ok] - traffic.enqueue_ms[ok]))))


def join_pace(first: np.ndarray, last: np.ndarray, joined: np.ndarray) -> float:
    """Requests per second whose first token came while others waited in the decode loop beside
    decoding rows: how fast the loop admits a queue (its join rule, the prefills, the pacer riding
    prompts in the steps), the rate a saturated loop serves at. Over the spans where a request was
    in the loop (`joined`: dispatched to it) without its first token while rows decoded; NaN when
    there were none."""
    edges = np.unique(np.concatenate([first, last, joined]))
    if len(edges) < 2:
        return math.nan
    spans = len(edges) - 1
    at_first, at_last, at_joined = (np.searchsorted(edges, t) for t in (first, last, joined))

    def covered(start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Whether some [start, end) of edge indices covers each span between two edges (a sweep:
        +1 where one begins, -1 where it ends)."""
        keep = start < end
        counts = np.zeros(spans + 1, dtype=np.int64)
        np.add.at(counts, start[keep], 1)
        np.add.at(counts, end[keep], -1)
        return np.cumsum(counts)[:spans] > 0

    busy = covered(at_joined, at_first) & covered(at_first, at_last)
    span_ms = float(np.diff(edges)[busy].sum())
    if span_ms <= 0:
        return math.nan
    closed = np.searchsorted(edges, first, side="left") - 1  # the span each first token ends
    came = closed >= 0
    came[came] = busy[closed[came]]
    return 1000.0 * float(came.sum()) / span_ms


def recorded_join_pace(traffic: RecordedTraffic) -> float:
    ok = (traffic.outcome == "ok") & (traffic.first_token_ms > 0) & (traffic.last_token_ms >= traffic.first_token_ms)
    return join_pace(traffic.first_token_ms[ok], traffic.last_token_ms[ok], (traffic.enqueue_ms + traffic.wait_ms)[ok])


def simulated_join_pace(run: GenRun) -> float:
    o = run.outcome
    ok = ~o.expired & np.isfinite(o.first_ms)
    return join_pace(o.first_ms[ok], o.done_ms[ok], o.dispatch_ms[ok])


@dataclass(frozen=True)
class GenRun:
    outcome: GenOutcome
    tokens_out: np.ndarray


def simulate_profile(
    setup: GenSetup, profile: BatchProfile, arrivals: GenArrivals, cost: GenerationCost, tokens_out: np.ndarray
) -> GenRun:
    lanes = int(arrivals.lane.max()) + 1 if len(arrivals) else 1
    engines = [setup.engine(profile) for _ in range(lanes)]
    outcome = simulate_generation(arrivals, cost, engines, setup.loop(profile), profile.max_inflight_batches)
    return GenRun(outcome, tokens_out)


def simulated_tpot(run: GenRun) -> np.ndarray:
    o = run.outcome
    out = run.tokens_out.astype(float)
    ok = ~o.expired & (out > 1)
    tpot = np.full(len(out), np.nan)
    tpot[ok] = (o.done_ms[ok] - o.first_ms[ok]) / (out[ok] - 1)
    return tpot


def device_scale(
    setup: GenSetup,
    profile: BatchProfile,
    arrivals: GenArrivals,
    cost: GenerationCost,
    tokens_out: np.ndarray,
    recorded: np.ndarray,
) -> float:
    """The factor on the profile's curves that makes the simulated time per output token match
    the recorded one (medians over the answers). Not proportional: slower steps also hold more
    rows in the running set, each step dearer still, so it is found by bisection (in log scale)."""
    target = float(np.nanmedian(recorded)) if np.isfinite(recorded).any() else math.nan
    if not math.isfinite(target) or target <= 0:
        return 1.0

    def tpot(scale: float) -> float:
        sim = simulated_tpot(simulate_profile(setup, profile, arrivals, cost.scaled(scale), tokens_out))
        return float(np.nanmedian(sim)) if np.isfinite(sim).any() else math.nan

    got = tpot(1.0)
    if not math.isfinite(got) or got <= 0:
        return 1.0
    lo = hi = 1.0
    if got < target:
        while got < target and hi < MAX_SCALE:
            lo, hi = hi, hi * 2.0
            got = tpot(hi)
    else:
        while got >= target and lo > 1.0 / MAX_SCALE:
            lo, hi = lo / 2.0, lo
            got = tpot(lo)
    for _ in range(CALIBRATION_PASSES):
        mid = math.sqrt(lo * hi)
        if tpot(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def tpot_misfit(simulated: np.ndarray, recorded: np.ndarray) -> float:
    """Mean |log| ratio of simulated to recorded time per output token, answer by answer."""
    both = np.isfinite(simulated) & np.isfinite(recorded) & (simulated > 0) & (recorded > 0)
    return float(np.mean(np.abs(np.log(simulated[both] / recorded[both])))) if both.any() else math.inf


@dataclass(frozen=True)
class Calibration:
    scale: float
    """Factor on the profile's prefill and decode-step curves."""
    step_overhead_ms: float
    """Fixed ms every decode step paid beyond its scaled curve."""
    misfit: float
    """Mean |log| ratio of simulated to recorded time per output token over the answers."""
    ride_ms_per_token: float | None = None
    """ms per ridden prompt token (measured, not scaled) that gives the recorded join pace; None: the
    profile's prefill slope, scaled."""


def calibrate_device(
    setup: GenSetup,
    profile: BatchProfile,
    arrivals: GenArrivals,
    cost: GenerationCost,
    tokens_out: np.ndarray,
    recorded: np.ndarray,
    pace: float = math.nan,
) -> Calibration:
    """The device during the recording, from what the answers' stamps measured:

    - a factor on the profile's curves and a fixed cost per decode step: the pair whose simulated
      time per output token is closest to the recorded one answer by answer. Each fixed cost tried
      (a share of the recorded median time per token, OVERHEAD_SHARES) gets the factor that matches
      the median (device_scale); the answers tell them apart: an answer that shared few rows decoded
      about as slowly as one that shared many when the fixed cost dominates, while scaled curves
      alone make the first much faster. Ties keep the smaller cost;
    - where joiners waited beside decoding rows (`pace`, recorded_join_pace), the cost per prompt
      token riding a step that makes the simulated loop admit its queue at the recorded pace: a
      saturated loop serves at that pace, and the profile's prefill slope (what a token adds to a
      forward pass measured alone) made the simulated one admit faster than the live one did."""
    target = float(np.nanmedian(recorded)) if np.isfinite(recorded).any() else math.nan
    if not math.isfinite(target) or target <= 0:
        return Calibration(1.0, 0.0, math.nan)

    def fit(trial: GenerationCost) -> Calibration:
        scale = device_scale(setup, profile, arrivals, trial, tokens_out, recorded)
        sim = simulated_tpot(simulate_profile(setup, profile, arrivals, trial.scaled(scale), tokens_out))
        return Calibration(scale, trial.step_overhead_ms, tpot_misfit(sim, recorded), trial.ride_measured_ms)

    def paced(trial: GenerationCost) -> GenerationCost:
        """`trial` with the ride cost per token (ms, measured: not scaled) whose simulated join pace is
        the recorded one, the device factor held at the one fitted to `trial`; unchanged when its
        pace is within PACE_TOLERANCE. Bisection in log scale, the bracket grown by doubling."""
        if not math.isfinite(pace) or pace <= 0 or not trial.ride_ms_per_token:
            return trial
        scale = device_scale(setup, profile, arrivals, trial, tokens_out, recorded)
        ride = trial.scaled(scale).ride_token_ms()
        assert ride is not None

        def simulated_pace(per_token: float) -> float:
            at = replace(trial, ride_measured_ms=per_token).scaled(scale)
            return simulated_join_pace(simulate_profile(setup, profile, arrivals, at, tokens_out))

        def too_fast(per_token: float) -> bool:
            got = simulated_pace(per_token)
            return not math.isfinite(got) or got > pace  # no queue at all: it admitted faster still

        got = simulated_pace(ride)
        if math.isfinite(got) and abs(got / pace - 1.0) <= PACE_TOLERANCE:
            return trial
        lo = hi = ride
        if not math.isfinite(got) or got > pace:
            while too_fast(hi) and hi < ride * RIDE_RANGE:
                lo, hi = hi, hi * 2.0
        else:
            while not too_fast(lo) and lo > ride / RIDE_RANGE:
                lo, hi = lo / 2.0, lo
        for _ in range(CALIBRATION_PASSES):
            mid = math.sqrt(lo * hi)
            if too_fast(mid):
                lo = mid
            else:
                hi = mid
        return replace(trial, ride_measured_ms=math.sqrt(lo * hi))

    def better(found: Calibration, best: Calibration) -> bool:
        if found.step_overhead_ms > best.step_overhead_ms:
            return found.misfit < best.misfit - MISFIT_TIE
        return found.misfit <= best.misfit + MISFIT_TIE

    def overhead(base: GenerationCost, shares: Sequence[float]) -> Calibration:
        """The best of `shares`, then half a grid step either side of it."""
        best = fit(base.with_step_overhead(shares[0] * target))
        for share in shares[1:]:
            found = fit(base.with_step_overhead(share * target))
            best = found if better(found, best) else best
        chosen = best.step_overhead_ms / target
        for share in (chosen - OVERHEAD_STEP / 2, chosen + OVERHEAD_STEP / 2):
            if 0.0 < share < OVERHEAD_SHARES[-1] + OVERHEAD_STEP / 2:
                found = fit(base.with_step_overhead(share * target))
                best = found if better(found, best) else best
        return best

    best = overhead(paced(cost), OVERHEAD_SHARES)
    if math.isfinite(pace) and best.step_overhead_ms > 0:  # the pace with that cost, then the cost at that pace
        again = paced(cost.with_step_overhead(best.step_overhead_ms))
        chosen = best.step_overhead_ms / target
        near = [share for share in (chosen - OVERHEAD_STEP, chosen, chosen + OVERHEAD_STEP) if share >= 0.0]
        best = overhead(replace(cost, ride_measured_ms=again.ride_measured_ms), near)
    return best


@dataclass(frozen=True)
class GenPrediction:
    p50_ms: float
    p99_ms: float
    throughput_rps: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    expired_share: float
    mean_batch: float
    mean_rows: float


def predict(
    setup: GenSetup,
    profile: BatchProfile,
    arrivals: GenArrivals,
    cost: GenerationCost,
    tokens_out: np.ndarray,
    overhead_ms: float,
) -> GenPrediction:
    run = simulate_profile(setup, profile, arrivals, cost, tokens_out)
    f = gen_figures(run.outcome, tokens_out, overhead_ms)
    sizes = run.outcome.batch_sizes
    return GenPrediction(
        f.p50_ms,
        f.p99_ms,
        f.throughput_rps,
        f.ttft_p99_ms,
        f.tpot_p99_ms,
        f.expired_share,
        float(np.mean(sizes)) if sizes else math.nan,
        f.mean_rows,
    )


def generation_candidates(ran: BatchProfile) -> list[tuple[str, BatchProfile]]:
    """The profile that ran, then the knobs that shape a running set: in-flight batches (the
    running rows) halved and doubled, the step budget off, and a longer window."""
    out = [("ran", ran)]
    slots = ran.max_inflight_batches
    for label, value in (("half", max(1, slots // 2)), ("double", slots * 2)):
        if value != slots:
            out.append((f"max_inflight {value} ({label})", ran.replace(max_inflight_batches=value)))
    out.append(("step budget 10 s", ran.replace(compute_budget_ms=10_000.0, slo_ms_per_new_token=0.0)))
    if ran.max_wait_ms != 50.0:
        out.append(("max_wait 50 ms", ran.replace(max_wait_ms=50.0, min_wait_ms=min(ran.min_wait_ms, 50.0))))
    return out


def replay_generation(
    traffic: RecordedTraffic, ran: BatchProfile, setup: GenSetup, *, calibrate: bool = True
) -> Replay:
    """Predict the profile that ran and the generation candidates on the recorded arrivals."""
    if setup.device.generation is None:
        raise GenerationReplayError(
            "the device profile has no prefill and decode-step curves (a generation profile written by "
            "`batchtide profile` is needed)"
        )
    if len(traffic) == 0:
        raise GenerationReplayError(f"no requests of model {traffic.model!r} recorded in this window")
    arrivals, order = generation_arrivals(traffic, setup.model, ran.default_deadline_ms)
    tokens_out = np.maximum(traffic.tokens_out, 0)[order]
    base = GenerationCost.from_curves(setup.device.generation)
    tpot = recorded_tpot(traffic)
    pace = recorded_join_pace(traffic)
    fit = (
        calibrate_device(setup, ran, arrivals, base, tokens_out, tpot[order], pace)
        if calibrate
        else Calibration(1.0, 0.0, math.nan)
    )
    cost = replace(base, ride_measured_ms=fit.ride_ms_per_token, step_overhead_ms=fit.step_overhead_ms).scaled(
        fit.scale
    )
    hops = hops_ms(traffic)
    figures = recorded_figures(traffic)
    ttft = recorded_ttft(traffic)
    recorded = replace(
        figures,
        overhead_ms=hops,
        ttft_p99_ms=float(np.nanpercentile(ttft, 99)) if np.isfinite(ttft).any() else math.nan,
        tpot_p99_ms=float(np.nanpercentile(tpot, 99)) if np.isfinite(tpot).any() else math.nan,
        device_scale=fit.scale,
        step_overhead_ms=fit.step_overhead_ms,
        join_pace_rps=pace,
        ride_ms_per_token=fit.ride_ms_per_token,
    )
    predictions = []
    for name, profile in generation_candidates(ran):
        g = predict(setup, profile, arrivals, cost, tokens_out, hops)
        predictions.append(
            Prediction(
                name=name,
                profile=profile,
                p50_ms=g.p50_ms,
                p99_ms=g.p99_ms,
                p999_ms=math.nan,
                throughput_rps=g.throughput_rps,
                hit_ratio=math.nan,
                expired_share=g.expired_share,
                marked_share=math.nan,
                mean_batch=g.mean_batch,
                ttft_p99_ms=g.ttft_p99_ms,
                tpot_p99_ms=g.tpot_p99_ms,
                mean_rows=g.mean_rows,
            )
        )
    return Replay(None, None, recorded, predictions)
