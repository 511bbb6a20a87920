"""`bench fleet-live`: a consumer group with a slow member, three ways, in one run.

Each case runs three times on the same broker, with the same seeded load:
a partition group with its balance off (`tail_forwarding = false`: Kafka's
equal partition counts and nothing else, mode `off`), a partition group
with tail forwarding (the default, `on`), and a share group (`share`,
docs/share-groups.md: any consumer pulls any request, in the layout share
mode recommends, one request partition unless the case sets its own). Its
p99 is read against its baseline case (the same group with every device
fast and evenly keyed load) in the same mode, from the same run, and
against the goal for that mode; a baseline case against its own `off` run,
where the goal is to cost nothing (p99 within 5%, under 1% of requests
forwarded); a share-mode baseline against the `on` baseline, for what share
mode itself costs (no goal). Two cases measure what partition groups cannot
do: 8 consumers on 2 partitions (its rate and p99 against 2 consumers on
the same 2 partitions, goal 3.5x the rate at most 1.5x the p99), and a
consumer added and removed under load (the p99 of each 5 s window against
the windows before the change: at most 3x for at most 10 s). Answers given
twice are counted on the results topic and past a reader that keeps the
first per request id.
A mid-run slowdown must also let the tail recover within 15 s of its end
(two 5 s windows in a row with p99 within 1.5x the baseline's). Cost-model
devices, t(b) = a + c*b, so the figures are the pipeline's own: Kafka hops,
the consumers, the forwards.

With `repeats` above one, each case runs off, on, off, on... (a new seed per
repeat) and every figure is the median trial's by p99 (the upper one for an
even count): on two shared cores one pair of trials differs by 10-15% from
the next with nothing changed, more than the 5% that equal devices are held to.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pipeline.core.config import KafkaSettings
from pipeline.tools.bench.pipeline.options import BenchOptions
from pipeline.tools.bench.pipeline.printout import describe
from pipeline.tools.bench.pipeline.trial import WINDOW_S, Trial, run_trial

RECOVERED_RATIO = 1.5
"""After a slowdown, the tail has recovered once every window's p99 is within this of the baseline's."""
RECOVERED_WINDOWS = 2
RECOVERY_GOAL_S = 15.0
EQUAL_FORWARD_SHARE = 0.01
"""Between equal devices, balancing may forward less than this share of the requests."""
SHARE_PARTITIONS = 1
"""Request partitions of a share-mode run unless the case sets its own: the layout share mode
recommends (every member shares the partition; docs/share-groups.md)."""
CHANGE_RATIO = 3.0
CHANGE_GOAL_S = 10.0
"""A consumer added or removed: the windows' p99 may exceed CHANGE_RATIO x the steady p99 for this long."""

Mode = Literal["off", "on", "share"]
MODES: tuple[Mode, ...] = ("off", "on", "share")


@dataclass(frozen=True)
class FleetCase:
    name: str
    consumers: int
    rate: float
    baseline: str
    """The case whose p99 (same mode; `on` for a partition group) this one is measured against; itself for a baseline."""
    goal: float
    """Largest p99 ratio to the baseline that meets the goal (balance on)."""
    share_goal: float | None = None
    """The same for share mode (None: no goal, the ratio is shown)."""
    straggler: float = 1.0
    slowdown: tuple[float, float, float] | None = None
    hot_share: float = 0.0
    duration_s: float = 60.0
    partitions: int | None = None
    """Request partitions in every mode (None: the bench's --partitions, and SHARE_PARTITIONS in share mode)."""
    cost_ms: tuple[float, float] | None = None
    """Each device's t(b) = a + c*b (None: A_MS, C_MS)."""
    rate_goal: float | None = None
    """Least throughput ratio to the baseline that meets the goal (more consumers on the same partitions)."""
    joins_at_s: float | None = None
    leaves_at_s: float | None = None
    """A consumer (the last) joins and leaves the group at these times into the load."""


A_MS, C_MS = 20.0, 2.0
"""Every device: t(b) = 20 + 2b ms, about 460 req/s at its knee."""
SMALL_A_MS, SMALL_C_MS = 40.0, 4.0
"""The 8-on-2 cases' devices, half as fast, so 8 of them stay within what two cores can feed."""
CASES: tuple[FleetCase, ...] = (
    FleetCase("2-equal", 2, 300.0, "2-equal", 1.05),
    FleetCase("2-straggler", 2, 300.0, "2-equal", 2.0, share_goal=1.6, straggler=3.0),
    FleetCase("2-slowdown", 2, 300.0, "2-equal", 2.0, share_goal=1.6, slowdown=(30.0, 90.0, 3.0), duration_s=120.0),
    FleetCase("2-hot", 2, 300.0, "2-equal", 1.5, share_goal=1.5, hot_share=0.5),
    FleetCase("4-equal", 4, 920.0, "4-equal", 1.05),
    FleetCase("4-straggler", 4, 920.0, "4-equal", 1.5, share_goal=1.6, straggler=3.0),
    FleetCase("4-hot", 4, 920.0, "4-equal", 1.5, share_goal=1.5, hot_share=0.5),
    FleetCase("2-on-2", 2, 80.0, "2-on-2", 1.05, partitions=2, cost_ms=(SMALL_A_MS, SMALL_C_MS)),
    FleetCase(
        "8-on-2", 8, 320.0, "2-on-2", 1.5, share_goal=1.5, partitions=2, cost_ms=(SMALL_A_MS, SMALL_C_MS), rate_goal=3.5
    ),
    FleetCase(
        "add-remove", 3, 300.0, "2-equal", CHANGE_RATIO, share_goal=CHANGE_RATIO, joins_at_s=20.0, leaves_at_s=40.0
    ),
)
"""N consumers, 4 partitions: N-equal every device fast; N-straggler consumer 0 3x slower throughout;
2-slowdown consumer 0 3x slower from 30 s to 90 s of 120 s; N-hot half the requests on one partition.
920 req/s is 60% of four devices of which one is 3x slower (3 x 460 + 153 req/s). 2-on-2 and 8-on-2:
2 and 8 consumers on 2 partitions, 40 req/s each (a partition group runs 2 of the 8); add-remove: two
consumers serving, a third joining at 20 s and leaving (a clean stop) at 40 s of 60 s."""


def case_options(base: BenchOptions, case: FleetCase, mode: Mode, duration_scale: float) -> BenchOptions:
    a_ms, c_ms = case.cost_ms or (A_MS, C_MS)
    partitions = case.partitions or (SHARE_PARTITIONS if mode == "share" else base.partitions)
    return replace(
        base,
        runner="cost-model",
        cost_a_ms=a_ms,
        cost_c_ms=c_ms,
        consumers=case.consumers,
        partitions=partitions,
        rates=(case.rate,),
        duration_s=case.duration_s * duration_scale,
        straggler=case.straggler,
        slowdown=None
        if case.slowdown is None
        else (case.slowdown[0] * duration_scale, case.slowdown[1] * duration_scale, case.slowdown[2]),
        hot_share=case.hot_share,
        tail_forwarding=mode == "on",
        group_type="share" if mode == "share" else "consumer",
        late_consumer_s=None if case.joins_at_s is None else case.joins_at_s * duration_scale,
        leaving_consumer_s=None if case.leaves_at_s is None else case.leaves_at_s * duration_scale,
    )


def recovered_after_s(trial: Trial, case: FleetCase, baseline_p99: float, duration_scale: float) -> float | None:
    """Seconds from the end of the slowdown to the first of RECOVERED_WINDOWS windows in a row whose
    p99 is back near the baseline's (one window alone can be luck, and one late spike the machine)."""
    if case.slowdown is None:
        return None
    end_s = case.slowdown[1] * duration_scale
    windows = trial.p99_by_window_ms
    near = [not math.isnan(p) and p <= RECOVERED_RATIO * baseline_p99 for p in windows]
    for w in range(math.ceil(end_s / WINDOW_S), len(windows) - RECOVERED_WINDOWS + 1):
        if all(near[w : w + RECOVERED_WINDOWS]):
            return max(0.0, w * WINDOW_S - end_s)
    return math.inf


def change_figures(trial: Trial, case: FleetCase, duration_scale: float) -> tuple[float, float, float] | None:
    """A consumer added and removed: (steady p99, worst window p99 / steady, seconds of windows above
    CHANGE_RATIO x steady). Steady is the p99 of the windows before the join (the first one left out:
    the load starting); the change, every window from the join on."""
    if case.joins_at_s is None:
        return None
    windows = trial.p99_by_window_ms
    join_w = int(case.joins_at_s * duration_scale // WINDOW_S)
    steady = [p for p in windows[1:join_w] if not math.isnan(p)]
    if not steady:
        return None
    base = sorted(steady)[len(steady) // 2]
    after = [p for p in windows[join_w:] if not math.isnan(p)]
    worst = max(after, default=math.nan) / base
    above = sum(WINDOW_S for p in after if p > CHANGE_RATIO * base)
    return base, worst, above


def median_trial(trials: list[Trial]) -> Trial:
    """The trial whose p99 is the median of the repeats' (the upper one of an even count)."""
    return sorted(trials, key=lambda t: t.p99_ms)[len(trials) // 2]


def _reference(trials: dict[tuple[str, Mode], Trial], case: FleetCase, mode: Mode) -> Trial | None:
    """What a row is held against: the baseline case in the same mode (a partition group's `on`); a
    baseline case itself against `off` (balance on) or `on` (share mode). None when it did not run."""
    if case.baseline == case.name:
        return trials.get((case.name, "on" if mode == "share" else "off"))
    return trials.get((case.baseline, "share" if mode == "share" else "on"))


async def run_fleet(
    base: BenchOptions,
    kafka: KafkaSettings,
    workdir: Path,
    say: Callable[[str], None],
    names: tuple[str, ...] = (),
    duration_scale: float = 1.0,
    repeats: int = 1,
    modes: tuple[Mode, ...] = MODES,
) -> dict[str, Any]:
    """Every case (or those named, and their baselines), in each of `modes`, `repeats` times; the
    table's rows as JSON-ready figures."""
    cases = [c for c in CASES if not names or c.name in names]
    needed = {c.baseline for c in cases}
    ordered = [c for c in CASES if c.name in needed and c not in cases] + cases
    run_modes = tuple(m for m in MODES if m in modes)
    runs: dict[tuple[str, Mode], list[Trial]] = {}
    for case in ordered:
        for repeat in range(repeats):
            for mode in run_modes:
                say(f"{case.name}: {mode}" + (f", repeat {repeat + 1}" if repeats > 1 else ""))
                options = replace(case_options(base, case, mode, duration_scale), seed=base.seed + repeat)
                trial = await run_trial(options, kafka, case.rate, workdir, say)
                say(describe(trial))
                runs.setdefault((case.name, mode), []).append(trial)
    trials = {key: median_trial(each) for key, each in runs.items()}
    rows = []
    for case in ordered:
        for mode in run_modes:
            trial = trials[(case.name, mode)]
            reference = _reference(trials, case, mode)
            ratio = trial.p99_ms / reference.p99_ms if reference is not None and reference.p99_ms > 0 else math.nan
            rate_ratio = (
                trial.throughput_rps / reference.throughput_rps
                if reference is not None and reference.throughput_rps > 0
                else math.nan
            )
            forwarded = trial.forwarded / max(trial.sent, 1)
            recovered = recovered_after_s(trial, case, (reference or trial).p99_ms, duration_scale)
            change = change_figures(trial, case, duration_scale)
            goal = case.share_goal if mode == "share" else case.goal
            if case.baseline == case.name and mode == "share":
                goal = None
            met = None
            if mode != "off" and goal is not None:
                met = (
                    (ratio <= goal if change is None else change[2] <= CHANGE_GOAL_S)
                    and (case.rate_goal is None or rate_ratio >= case.rate_goal)
                    and (case.baseline != case.name or forwarded < EQUAL_FORWARD_SHARE)
                    and (recovered is None or recovered <= RECOVERY_GOAL_S)
                    and trial.answered == trial.sent
                    and trial.repeated_past_dedup == 0
                )
            rows.append({
                "case": case.name,
                "mode": mode,
                "balance": mode == "on",
                "partitions": case_options(base, case, mode, duration_scale).partitions,
                "p50_ms": trial.p50_ms,
                "p99_ms": trial.p99_ms,
                "p999_ms": trial.p999_ms,
                "p99_vs_baseline": ratio,
                "rate_vs_baseline": rate_ratio,
                "throughput_rps": trial.throughput_rps,
                "goal": goal,
                "rate_goal": case.rate_goal,
                "met": met,
                "forwarded_share": forwarded,
                "answered": trial.answered,
                "sent": trial.sent,
                "repeated": trial.duplicates,
                "repeated_past_dedup": trial.repeated_past_dedup,
                "recovered_after_s": recovered,
                "change": None if change is None else {"steady_p99_ms": change[0], "worst_ratio": change[1], "above_s": change[2]},
                "p99_each_ms": [t.p99_ms for t in runs[(case.name, mode)]],
                "by_consumer": trial.by_consumer,
                "trial": asdict(trial),
            })  # fmt: skip
    return {"fleet": rows}


def fleet_table(rows: list[dict[str, Any]]) -> list[str]:
    """The report: one line per case and mode."""
    lines = [
        f"{'case':<12} {'mode':<5} {'parts':>5} {'p50':>7} {'p99':>7} {'p999':>7} {'vs base':>8} {'goal':>5} "
        f"{'fwd':>6} {'answered':>11} {'twice':>5} {'past':>4}  p99 by consumer"
    ]
    for r in rows:
        each = ", ".join(f"{name}: {f['p99_ms']:.0f}" for name, f in r["by_consumer"].items())
        recovered = r["recovered_after_s"]
        note = "" if recovered is None else f"  (tail recovered {recovered:.0f} s after the slowdown)"
        if r["rate_goal"] is not None:
            note += f"  (rate {r['throughput_rps']:.0f} req/s, {r['rate_vs_baseline']:.2f}x the baseline's; goal {r['rate_goal']:.1f}x)"
        if r["change"] is not None:
            c = r["change"]
            note += (
                f"  (steady p99 {c['steady_p99_ms']:.0f} ms; worst window {c['worst_ratio']:.2f}x; "
                f"{c['above_s']:.0f} s above {CHANGE_RATIO:.0f}x, goal <= {CHANGE_GOAL_S:.0f} s)"
            )
        if len(r["p99_each_ms"]) > 1:
            note += "  (p99 of each repeat: " + ", ".join(f"{p:.0f}" for p in r["p99_each_ms"]) + ")"
        verdict = "" if r["met"] is None else ("met" if r["met"] else "MISSED")
        goal = "-" if r["goal"] is None else f"{r['goal']:.2f}x"
        lines.append(
            f"{r['case']:<12} {r['mode']:<5} {r['partitions']:>5} {r['p50_ms']:>7.0f} {r['p99_ms']:>7.0f} "
            f"{r['p999_ms']:>7.0f} {r['p99_vs_baseline']:>7.2f}x {goal:>5} {r['forwarded_share']:>6.1%} "
            f"{r['answered']:>5}/{r['sent']:<5} {r['repeated']:>5} {r['repeated_past_dedup']:>4}  {each}{note} {verdict}"
        )
    return lines
