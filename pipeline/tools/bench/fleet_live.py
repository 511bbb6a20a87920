"""`bench fleet-live`: a consumer group with a slow member, balance off and on, in one run.

Each case runs twice on the same broker, with the same seeded load: with
the group's balance off (`tail_forwarding = false`: Kafka's equal
partition counts and nothing else) and on (the default). Its p99 is read
against its baseline case (the same group with every device fast and
evenly keyed load), balance on, from the same run, and against the goal
for that case; a baseline case against its own balance-off run, where the
goal is to cost nothing (p99 within 5%, under 1% of requests forwarded).
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
from typing import Any

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


@dataclass(frozen=True)
class FleetCase:
    name: str
    consumers: int
    rate: float
    baseline: str
    """The case whose p99 (balance on) this one is measured against; itself for a baseline."""
    goal: float
    """Largest p99 ratio to the baseline that meets the goal (balance on)."""
    straggler: float = 1.0
    slowdown: tuple[float, float, float] | None = None
    hot_share: float = 0.0
    duration_s: float = 60.0


A_MS, C_MS = 20.0, 2.0
"""Every device: t(b) = 20 + 2b ms, about 460 req/s at its knee."""
CASES: tuple[FleetCase, ...] = (
    FleetCase("2-equal", 2, 300.0, "2-equal", 1.05),
    FleetCase("2-straggler", 2, 300.0, "2-equal", 2.0, straggler=3.0),
    FleetCase("2-slowdown", 2, 300.0, "2-equal", 2.0, slowdown=(30.0, 90.0, 3.0), duration_s=120.0),
    FleetCase("2-hot", 2, 300.0, "2-equal", 1.5, hot_share=0.5),
    FleetCase("4-equal", 4, 920.0, "4-equal", 1.05),
    FleetCase("4-straggler", 4, 920.0, "4-equal", 1.5, straggler=3.0),
    FleetCase("4-hot", 4, 920.0, "4-equal", 1.5, hot_share=0.5),
)
"""N consumers, 4 partitions: N-equal every device fast; N-straggler consumer 0 3x slower throughout;
2-slowdown consumer 0 3x slower from 30 s to 90 s of 120 s; N-hot half the requests on one partition.
920 req/s is 60% of four devices of which one is 3x slower (3 x 460 + 153 req/s)."""


def case_options(base: BenchOptions, case: FleetCase, balance: bool, duration_scale: float) -> BenchOptions:
    return replace(
        base,
        runner="cost-model",
        cost_a_ms=A_MS,
        cost_c_ms=C_MS,
        consumers=case.consumers,
        rates=(case.rate,),
        duration_s=case.duration_s * duration_scale,
        straggler=case.straggler,
        slowdown=None
        if case.slowdown is None
        else (case.slowdown[0] * duration_scale, case.slowdown[1] * duration_scale, case.slowdown[2]),
        hot_share=case.hot_share,
        tail_forwarding=balance,
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


def median_trial(trials: list[Trial]) -> Trial:
    """The trial whose p99 is the median of the repeats' (the upper one of an even count)."""
    return sorted(trials, key=lambda t: t.p99_ms)[len(trials) // 2]


async def run_fleet(
    base: BenchOptions,
    kafka: KafkaSettings,
    workdir: Path,
    say: Callable[[str], None],
    names: tuple[str, ...] = (),
    duration_scale: float = 1.0,
    repeats: int = 1,
) -> dict[str, Any]:
    """Every case (or those named, and their baselines), balance off then on, `repeats` times; the
    table's rows as JSON-ready figures."""
    cases = [c for c in CASES if not names or c.name in names]
    needed = {c.baseline for c in cases}
    ordered = [c for c in CASES if c.name in needed and c not in cases] + cases
    runs: dict[tuple[str, bool], list[Trial]] = {}
    for case in ordered:
        for repeat in range(repeats):
            for balance in (False, True):
                say(
                    f"{case.name}: balance {'on' if balance else 'off'}"
                    + (f", repeat {repeat + 1}" if repeats > 1 else "")
                )
                options = replace(case_options(base, case, balance, duration_scale), seed=base.seed + repeat)
                trial = await run_trial(options, kafka, case.rate, workdir, say)
                say(describe(trial))
                runs.setdefault((case.name, balance), []).append(trial)
    trials = {key: median_trial(each) for key, each in runs.items()}
    rows = []
    for case in ordered:
        # a baseline case is held against its own balance-off run: balancing equal devices must cost nothing
        reference = trials[(case.baseline, case.baseline != case.name)].p99_ms
        for balance in (False, True):
            trial = trials[(case.name, balance)]
            ratio = trial.p99_ms / reference if reference > 0 else math.nan
            forwarded = trial.forwarded / max(trial.sent, 1)
            recovered = recovered_after_s(trial, case, trials[(case.baseline, True)].p99_ms, duration_scale)
            met = (
                balance
                and ratio <= case.goal
                and (case.baseline != case.name or forwarded < EQUAL_FORWARD_SHARE)
                and (recovered is None or recovered <= RECOVERY_GOAL_S)
            )
            rows.append({
                "case": case.name,
                "balance": balance,
                "p50_ms": trial.p50_ms,
                "p99_ms": trial.p99_ms,
                "p999_ms": trial.p999_ms,
                "p99_vs_baseline": ratio,
                "goal": case.goal,
                "met": met,
                "forwarded_share": forwarded,
                "answered": trial.answered,
                "sent": trial.sent,
                "recovered_after_s": recovered,
                "p99_each_ms": [t.p99_ms for t in runs[(case.name, balance)]],
                "by_consumer": trial.by_consumer,
                "trial": asdict(trial),
            })  # fmt: skip
    return {"fleet": rows}


def fleet_table(rows: list[dict[str, Any]]) -> list[str]:
    """The report: one line per case and balance setting."""
    lines = [
        f"{'case':<12} {'balance':<7} {'p50':>7} {'p99':>7} {'p999':>7} {'vs base':>8} {'goal':>5} "
        f"{'fwd':>6} {'answered':>11}  p99 by consumer"
    ]
    for r in rows:
        each = ", ".join(f"{name}: {f['p99_ms']:.0f}" for name, f in r["by_consumer"].items())
        recovered = r["recovered_after_s"]
        note = "" if recovered is None else f"  (tail recovered {recovered:.0f} s after the slowdown)"
        if len(r["p99_each_ms"]) > 1:
            note += "  (p99 of each repeat: " + ", ".join(f"{p:.0f}" for p in r["p99_each_ms"]) + ")"
        verdict = ("met" if r["met"] else "MISSED") if r["balance"] else ""
        lines.append(
            f"{r['case']:<12} {'on' if r['balance'] else 'off':<7} {r['p50_ms']:>7.0f} {r['p99_ms']:>7.0f} "
            f"{r['p999_ms']:>7.0f} {r['p99_vs_baseline']:>7.2f}x {r['goal']:>4.2f}x {r['forwarded_share']:>6.1%} "
            f"{r['answered']:>5}/{r['sent']:<5}  {each}{note} {verdict}"
        )
    return lines
