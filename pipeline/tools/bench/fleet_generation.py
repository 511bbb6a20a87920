"""`bench fleet-live --cases generation`: a group of generating consumers with a really slower member.

Each case runs SmolLM2 (the shipped GGUF, iteration-level batching) in two
`batchtide consume` processes of one group, each pinned to its own core
(`taskset`). The slow member is not a cost model: a co-tenant, a process
that only spins, is pinned to consumer 0's core (`co_tenant.CoTenant`), so
that consumer's real decode steps take about twice as long. Cases:

- `gen-2-equal`: both consumers alone on their cores (the baseline);
- `gen-2-slow`: the co-tenant on consumer 0's core throughout;
- `gen-2-slowdown`: the co-tenant from a third to two thirds of the load.

Each case runs with the group's balance off (`tail_forwarding = false`) and
on, on the same broker with the same seeded load (max_new_tokens uniform
8..128); a slow case is read against `gen-2-equal` with balance on from the
same run, the baseline against its own balance-off run. The report gives
TTFT p99, TPOT p99 and e2e p99 (client send to answer), the forwarded share,
and per consumer the requests it answered, its generated tokens/s over the
second half of the load and its own TTFT and TPOT p99.

Goals: with one consumer about 2x slower and the balance on, TTFT p99 and
e2e p99 at most GOAL_RATIO x the all-equal pair's and every request answered
exactly once (answered = sent, no duplicate); with equal consumers, at most
EQUAL_FORWARD_SHARE forwarded and e2e p99 within EQUAL_P99_SHARE of balance
off. With `repeats` each pair runs off, on, on, off, off, on... (every
other repeat reversed) and every figure is the median trial's by e2e p99.
`balances` picks the settings to run, in order (a
trial of SmolLM2 takes about two minutes, so a slow case's off and on may
go in two invocations): a slow case's reference, the all-equal pair with
the balance on, runs in each, so every ratio is still within one run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.core.config import KafkaSettings
from pipeline.tools.bench.fleet_live import median_trial
from pipeline.tools.bench.pipeline.options import BenchOptions
from pipeline.tools.bench.pipeline.trial import Trial, run_trial

GOAL_RATIO = 2.0
EQUAL_FORWARD_SHARE = 0.01
EQUAL_P99_SHARE = 0.05
DEFAULT_RATE = 1.6
"""Requests per second offered to the pair: about half of what two SmolLM2 consumers on one core
each generate at the mixed lengths on this 2-core host, so that the slow one alone (half a core) is
near its limit with half the load (`bench fleet-live --cases generation --gen-rate R` to change)."""
BASELINE = "gen-2-equal"
WARMUP_S = 8.0
"""Warm-up before each trial's load: about 16 short answers per consumer, so that each has learned its
decode loop (`decode_forwarding.LEARN_AFTER` answers) before the measured requests arrive, as a consumer
that has served for a while has."""


@dataclass(frozen=True)
class GenerationCase:
    name: str
    co_tenant: tuple[float | None, float | None] | None
    """Over which share of the load (from, to) the co-tenant shares consumer 0's core (None: no co-tenant;
    a None end: from the consumers' start, or to the trial's end)."""
    duration_s: float = 60.0


CASES: tuple[GenerationCase, ...] = (
    GenerationCase(BASELINE, None),
    GenerationCase("gen-2-slow", (None, None)),
    GenerationCase("gen-2-slowdown", (1 / 3, 2 / 3), duration_s=90.0),
)
NAMES = tuple(c.name for c in CASES)


def case_options(
    base: BenchOptions, case: GenerationCase, balance: bool, rate: float, duration_scale: float
) -> BenchOptions:
    duration = case.duration_s * duration_scale
    span = case.co_tenant
    return replace(
        base,
        runner="smollm",
        llm_mode="iteration",
        lengths="mixed",
        torch_threads=1,
        consumers=2,
        rates=(rate,),
        duration_s=duration,
        pin_cores=True,
        llm_warmup_s=WARMUP_S,
        co_tenant=None if span is None else tuple(None if x is None else x * duration for x in span),  # type: ignore[arg-type]
        tail_forwarding=balance,
    )


def balance_settings(case: GenerationCase, asked: bool, balances: tuple[bool, ...]) -> tuple[bool, ...]:
    """The balance settings a case runs with: the asked ones; a slow case's reference (the all-equal pair,
    balance on) always; the all-equal pair's balance-off run as its own reference when its balance-on
    run is asked."""
    if case.name != BASELINE:
        return balances
    if not asked:
        return (True,)
    return balances if False in balances else (False, *balances)


def repeat_order(settings: tuple[bool, ...], repeat: int) -> tuple[bool, ...]:
    """The order a repeat runs its balance settings in: as asked, reversed every other repeat (a host
    that drifts over an invocation then favours neither setting)."""
    return settings if repeat % 2 == 0 else settings[::-1]


def _ratio(value: float, reference: float) -> float:
    return value / reference if reference > 0 and not math.isnan(value) else math.nan


async def run_generation_fleet(
    base: BenchOptions,
    kafka: KafkaSettings,
    workdir: Path,
    say: Callable[[str], None],
    names: tuple[str, ...] = (),
    duration_scale: float = 1.0,
    repeats: int = 1,
    rate: float = DEFAULT_RATE,
    balances: tuple[bool, ...] = (False, True),
) -> dict[str, Any]:
    """Every generation case (or those named, and the baseline), with the balance off then on (or as
    `balances` says), `repeats` times; the table's rows as JSON-ready figures."""
    cases = [c for c in CASES if not names or c.name in names]
    ordered = [c for c in CASES if c.name == BASELINE and c not in cases] + cases
    runs: dict[tuple[str, bool], list[Trial]] = {}
    settings = {c.name: balance_settings(c, c in cases, balances) for c in ordered}
    for case in ordered:
        for repeat in range(repeats):
            for balance in repeat_order(settings[case.name], repeat):
                say(
                    f"{case.name}: balance {'on' if balance else 'off'}"
                    + (f", repeat {repeat + 1}" if repeats > 1 else "")
                )
                options = replace(case_options(base, case, balance, rate, duration_scale), seed=base.seed + repeat)
                trial = await run_trial(options, kafka, rate, workdir, say, read_events=True)
                say(describe_generation(trial))
                runs.setdefault((case.name, balance), []).append(trial)
    return {"generation_fleet": generation_rows([c.name for c in ordered], settings, runs), "rate": rate}


def generation_rows(
    ordered: list[str], settings: dict[str, tuple[bool, ...]], runs: dict[tuple[str, bool], list[Trial]]
) -> list[dict[str, Any]]:
    """Each case's median trial per balance setting, read against its reference and judged by the goals."""
    trials = {key: median_trial(each) for key, each in runs.items()}
    rows = []
    for name in ordered:
        baseline = name == BASELINE
        for balance in settings[name]:
            trial = trials[(name, balance)]
            # the all-equal pair with the balance on is held against its own balance-off run (when it ran)
            reference = trials.get((BASELINE, not baseline), trial)
            forwarded = trial.forwarded / max(trial.sent, 1)
            e2e, ttft = _ratio(trial.p99_ms, reference.p99_ms), _ratio(trial.ttft_p99_ms, reference.ttft_p99_ms)
            if reference is trial and not (baseline and not balance):
                e2e = ttft = math.nan
            once = trial.answered == trial.sent and trial.duplicates == 0
            met: bool | None
            if baseline and math.isnan(e2e):
                met = None  # run only as the slow cases' reference: no balance-off run to judge it against
            elif baseline:
                met = forwarded <= EQUAL_FORWARD_SHARE and e2e <= 1.0 + EQUAL_P99_SHARE and once
            else:
                met = e2e <= GOAL_RATIO and ttft <= GOAL_RATIO and once
            rows.append({
                "case": name,
                "balance": balance,
                "ttft_p99_ms": trial.ttft_p99_ms,
                "tpot_p99_ms": trial.tpot_p99_ms,
                "e2e_p99_ms": trial.p99_ms,
                "ttft_vs_baseline": ttft,
                "e2e_vs_baseline": e2e,
                "met": met if balance else False,
                "forwarded": trial.forwarded,
                "forwarded_share": forwarded,
                "answered": trial.answered,
                "sent": trial.sent,
                "duplicates": trial.duplicates,
                "generated_tokens_per_s": trial.steady_generated_tokens_per_s,
                "e2e_p99_each_ms": [t.p99_ms for t in runs[(name, balance)]],
                "by_consumer": trial.by_consumer,
                "trial": asdict(trial),
            })  # fmt: skip
    return rows


def describe_generation(trial: Trial) -> str:
    each = "; ".join(
        f"{name}: {f.get('requests', 0):.0f} req, {f.get('generated_tokens_per_s', math.nan):.0f} tok/s"
        for name, f in trial.by_consumer.items()
    )
    return (
        f"  answered {trial.answered}/{trial.sent}, TTFT p99 {trial.ttft_p99_ms:.0f} ms, TPOT p99 "
        f"{trial.tpot_p99_ms:.0f} ms, e2e p99 {trial.p99_ms:.0f} ms, {trial.forwarded} forwarded ({each})"
    )


def _times(ratio: float) -> str:
    return "-" if math.isnan(ratio) else f"{ratio:.2f}x"


def generation_table(rows: list[dict[str, Any]]) -> list[str]:
    """The report: one line per case and balance setting, then one per consumer."""
    lines = [
        f"{'case':<15} {'balance':<7} {'TTFT p99':>9} {'TPOT p99':>9} {'e2e p99':>9} {'TTFT vs':>8} {'e2e vs':>7} "
        f"{'fwd':>5} {'fwd %':>6} {'answered':>9} {'tok/s':>6}"
    ]
    for r in rows:
        verdict = ("met" if r["met"] else "MISSED") if r["balance"] and r["met"] is not None else ""
        repeats = r["e2e_p99_each_ms"]
        note = "  (e2e p99 of each repeat: " + ", ".join(f"{p:.0f}" for p in repeats) + ")" if len(repeats) > 1 else ""
        lines.append(
            f"{r['case']:<15} {'on' if r['balance'] else 'off':<7} {r['ttft_p99_ms']:>9.0f} {r['tpot_p99_ms']:>9.0f} "
            f"{r['e2e_p99_ms']:>9.0f} {_times(r['ttft_vs_baseline']):>8} {_times(r['e2e_vs_baseline']):>7} "
            f"{r['forwarded']:>5} {r['forwarded_share']:>6.1%} {r['answered']:>4}/{r['sent']:<4} "
            f"{r['generated_tokens_per_s']:>6.0f} {verdict}{note}"
        )
        for name, f in r["by_consumer"].items():
            lines.append(
                f"{'':<15} {name:<11} {f.get('requests', 0):>5.0f} req {f.get('generated_tokens_per_s', math.nan):>6.1f} "
                f"tok/s  TTFT p99 {f.get('ttft_p99_ms', math.nan):>7.0f}  TPOT p99 {f.get('tpot_p99_ms', math.nan):>5.0f}"
                f"  e2e p99 {f.get('p99_ms', math.nan):>7.0f}"
            )
    return lines
