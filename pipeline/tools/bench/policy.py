"""The policy bench of one scenario, and the suite over every shipped scenario.

`bench_policies` searches every family over its own grid (pipeline/core/sim/search.py)
and adds three fixed rows: batchtide-default (BatchProfile() untouched),
batchtide-nomark (the same with tail marking off: the ablation) and
seed-baseline (the field report's fixed 20 ms wait, cap 48). `bench_suite`
runs that on every scenario, compares batchtide-default with each family's
per-scenario oracle best, and finds the one fixed-window config that does best
across the whole suite (the operator's real situation: one config, no oracle).
On a scenario whose requests carry deadlines it also compares goodput
(pipeline/tools/bench/goodput.py), at the nominal load and in overload.
"""

from __future__ import annotations

import math
import multiprocessing
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.sim.families import (
    FIXED_WINDOW,
    SEED_BASELINE,
    Config,
    Family,
    default_profile_config,
    engine_available,
    families,
)
from pipeline.core.sim.scenario import Scenario
from pipeline.core.sim.scenario_file import load_scenario
from pipeline.core.sim.search import STEP, Candidate, Evaluation, Evaluator, multiplier
from pipeline.tools.bench.goodput import GOODPUT_TARGET, goodput_table

MAX_GRID_CAP = 128
CAPACITY_TARGET = 0.97
P99_TARGET = 1.1

Progress = Callable[[str], None]


@dataclass
class PolicyBench:
    scenario: Scenario
    rows: list[Evaluation]
    physical_limit_rps: float
    simulator_requests_per_s: float
    runs: int
    evaluator: Evaluator
    window_effect: dict[str, Any] = field(default_factory=dict)
    goodput: list[dict[str, Any]] = field(default_factory=list)
    """Per load, where requests carry deadlines: batchtide-default's goodput against each family's best."""

    def row(self, name: str) -> Evaluation | None:
        return next((r for r in self.rows if r.candidate.family == name), None)

    def as_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "source": self.scenario.source,
            "slo_p99_ms": self.scenario.slo_p99_ms,
            "physical_limit_rps": self.physical_limit_rps,
            "simulator_requests_per_s": self.simulator_requests_per_s,
            "simulated_runs": self.runs,
            "policies": [policy_row(r) for r in self.rows],
            "window_effect": self.window_effect,
            "deadline_ms": self.scenario.deadline_ms,
            "goodput": self.goodput,
        }


def policy_row(ev: Evaluation) -> dict[str, Any]:
    metrics = ev.nominal.as_dict()
    metrics.pop("requests", None)
    return {
        "policy": ev.candidate.family,
        "config": ev.candidate.config,
        **metrics,
        "capacity_at_slo": round(ev.capacity_at_slo, 4),
    }


def physical_limit_rps(scenario: Scenario) -> float:
    """max over b <= cap of b / t(b) for the whole deployment (devices; heavier curve if it shifts)."""
    topo = scenario.topology
    per_device = scenario.cost.physical_limit_rps(MAX_GRID_CAP, scenario.mean_tokens())
    if topo.mode == "shared-device" and topo.model_cost_scale:
        share = topo.model_share or tuple(1.0 for _ in topo.model_cost_scale)
        mean_scale = sum(s * c for s, c in zip(share, topo.model_cost_scale, strict=True)) / sum(share)
        return per_device / mean_scale
    return per_device * topo.devices


def bench_policies(
    scenario: Scenario, quick: bool = False, progress: Progress | None = None, evaluator: Evaluator | None = None
) -> PolicyBench:
    ev = evaluator or Evaluator(scenario)
    rows: list[Evaluation] = []
    for family in families():
        if progress:
            progress(f"{scenario.name}: {family.name}")
        cands = [Candidate(family.name, cfg) for cfg in family.configs(scenario, quick)]
        rows.append(ev.best_of(cands))
    if progress:
        progress(f"{scenario.name}: fixed rows")
    if engine_available():
        rows.append(ev.evaluate(Candidate("batchtide-default", default_profile_config())))
        nomark = {**default_profile_config(), "tail_mark_ratio": 0.0}
        rows.append(ev.evaluate(Candidate("batchtide-nomark", nomark)))
    rows.append(ev.evaluate(Candidate("seed-baseline", dict(SEED_BASELINE))))
    effect = window_effect(ev, scenario, quick)
    goodput = goodput_table(ev, scenario, quick, progress)
    rate = ev.requests_simulated / ev.sim_seconds if ev.sim_seconds > 0 else 0.0
    return PolicyBench(scenario, rows, physical_limit_rps(scenario), rate, ev.runs, ev, effect, goodput)


def window_effect(ev: Evaluator, scenario: Scenario, quick: bool) -> dict[str, Any]:
    """Does waiting pay here? The best greedy fixed config (window 0) against the best with a window."""
    cfgs = FIXED_WINDOW.configs(scenario, quick)
    out: dict[str, Any] = {}
    for label, subset in (
        ("greedy", [c for c in cfgs if c["window_ms"] == 0]),
        ("windowed", [c for c in cfgs if c["window_ms"] > 0]),
    ):
        best = ev.best_of([Candidate(FIXED_WINDOW.name, c) for c in subset])
        out[label] = {
            "config": best.candidate.config,
            "capacity_at_slo": round(best.capacity_at_slo, 4),
            "p99_ms": best.nominal.p99_ms,
        }
    out["window_helps_capacity"] = out["windowed"]["capacity_at_slo"] > out["greedy"]["capacity_at_slo"]
    out["windowed_p99_ratio"] = _ratio(out["windowed"]["p99_ms"], out["greedy"]["p99_ms"])
    return out


# ---- suite ----------------------------------------------------------------------------


@dataclass
class SuiteResult:
    benches: list[PolicyBench]
    comparisons: list[dict[str, Any]]
    best_fixed: dict[str, Any]
    default_worst: dict[str, Any]
    simulator_requests_per_s: float
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "scenarios": [b.as_json() for b in self.benches],
            "comparisons": self.comparisons,
            "best_single_fixed_config": self.best_fixed,
            "batchtide_default_worst": self.default_worst,
            "simulator_requests_per_s": self.simulator_requests_per_s,
            "targets": {
                "capacity_ratio_min": CAPACITY_TARGET,
                "p99_ratio_max": P99_TARGET,
                "goodput_ratio_min": GOODPUT_TARGET,
            },
            "notes": self.notes,
        }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)) or (isinstance(b, float) and math.isnan(b)):
        return None
    if b == 0:
        return math.inf if a > 0 else 1.0
    return a / b


def compare(bench: PolicyBench, subject: str = "batchtide-default") -> dict[str, Any]:
    """Subject's capacity and p99 ratios against every family's best and the seed baseline."""
    me = bench.row(subject)
    out: dict[str, Any] = {"scenario": bench.scenario.name, "subject": subject, "vs": {}}
    if me is None:
        return out
    for r in bench.rows:
        if r.candidate.family == subject:
            continue
        cap = _ratio(me.capacity_at_slo, r.capacity_at_slo)
        p99 = _ratio(me.nominal.p99_ms, r.nominal.p99_ms)
        out["vs"][r.candidate.family] = {
            "capacity_ratio": cap,
            "p99_ratio": p99,
            "meets_targets": bool(cap is not None and p99 is not None and cap >= CAPACITY_TARGET and p99 <= P99_TARGET),
        }
    searched = [f.name for f in families()]
    out["meets_all_family_targets"] = all(out["vs"][f]["meets_targets"] for f in searched if f in out["vs"])
    if bench.goodput:
        out["goodput_ratio"] = {str(row["load"]): row["ratio"] for row in bench.goodput}
        out["meets_goodput_target"] = all(row["meets_target"] for row in bench.goodput)
    return out


def oracle_k(bench: PolicyBench) -> int:
    """Capacity index of the best searched family on this scenario."""
    names = {f.name for f in families()}
    return max(r.capacity_k for r in bench.rows if r.candidate.family in names)


def _within_device(cfg: Config, scenario: Scenario) -> Config:
    limit = scenario.cost.max_batch
    return {**cfg, "cap": limit} if limit is not None and cfg["cap"] > limit else dict(cfg)


def best_single_fixed(
    benches: list[PolicyBench], family: Family = FIXED_WINDOW, quick: bool = False, progress: Progress | None = None
) -> dict[str, Any]:
    """One fixed-window config for every scenario, maximising its worst capacity ratio to the
    per-scenario oracle (ties: lower worst p99 ratio). A config is first tested at the
    loads that would beat the best worst-ratio found so far, and dropped if it fails one."""
    oracles = {b.scenario.name: oracle_k(b) for b in benches}
    base_configs = family.quick_grid if quick else family.grid
    best: dict[str, Any] | None = None
    best_d: int | None = None
    for raw in base_configs:
        if progress:
            progress(f"suite: fixed-window {raw['window_ms']:g} ms cap {raw['cap']}")
        per: dict[str, int] = {}
        alive = True
        for b in benches:
            cand = Candidate(family.name, _within_device(raw, b.scenario))
            need = None if best_d is None else oracles[b.scenario.name] + best_d
            k = b.evaluator.capacity(cand, need)
            if k is None:
                alive = False
                break
            per[b.scenario.name] = k
        if not alive:
            continue
        d = min(per[n] - oracles[n] for n in per)
        p99s = {}
        for b in benches:
            cap_cfg = _within_device(raw, b.scenario)
            oracle_p99 = min(r.nominal.p99_ms for r in b.rows if r.candidate.family in {f.name for f in families()})
            mine = b.evaluator.nominal(Candidate(family.name, cap_cfg))[0].p99_ms
            p99s[b.scenario.name] = _ratio(mine, oracle_p99)
        worst_p99 = max(v for v in p99s.values() if v is not None)
        if best is None or best_d is None or d > best_d or (d == best_d and worst_p99 < best["worst_p99_ratio"]):
            best_d = d
            worst_scn = min(per, key=lambda n: per[n] - oracles[n])
            best = {
                "config": raw,
                "worst_capacity_ratio": STEP**d,
                "worst_scenario": worst_scn,
                "regret": 1 - STEP**d,
                "worst_p99_ratio": worst_p99,
                "capacity_ratio": {n: STEP ** (per[n] - oracles[n]) for n in per},
                "p99_ratio_vs_best_p99": p99s,
            }
    return best or {}


def default_worst(benches: list[PolicyBench]) -> dict[str, Any]:
    per = {}
    for b in benches:
        me = b.row("batchtide-default")
        if me is None:
            continue
        per[b.scenario.name] = multiplier(me.capacity_k - oracle_k(b))
    if not per:
        return {}
    worst = min(per, key=per.__getitem__)
    return {
        "worst_capacity_ratio": per[worst],
        "worst_scenario": worst,
        "regret": 1 - per[worst],
        "capacity_ratio": per,
    }


def scenario_files(directory: str | Path) -> list[Path]:
    """The policy bench's scenarios: fleet scenarios (a `[fleet]` table) are `bench fleet`'s."""
    return sorted(p for p in Path(directory).glob("*.toml") if not _is_fleet(p))


def _is_fleet(path: Path) -> bool:
    try:
        return "fleet" in tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False  # loading it reports the problem


def _bench_file(args: tuple[str, bool]) -> PolicyBench:
    """Worker: bench one scenario file; drop what need not travel back (arrivals, run outcomes
    other than the rows')."""
    path, quick = args
    bench = bench_policies(load_scenario(path), quick)
    bench.evaluator.compact()
    return bench


def bench_suite(
    directory: str | Path,
    quick: bool = False,
    progress: Progress | None = None,
    on_run: Callable[[], None] | None = None,
    jobs: int = 1,
) -> SuiteResult:
    paths = scenario_files(directory)
    benches: list[PolicyBench] = []
    if jobs > 1 and len(paths) > 1:
        with multiprocessing.get_context("spawn").Pool(min(jobs, len(paths))) as pool:
            for bench in pool.imap_unordered(_bench_file, [(str(p), quick) for p in paths]):
                benches.append(bench)
                if progress:
                    progress(f"{len(benches)}/{len(paths)} scenarios done ({bench.scenario.name})")
        benches.sort(key=lambda b: paths.index(Path(b.scenario.source)))
    else:
        for path in paths:
            scenario = load_scenario(path)
            benches.append(bench_policies(scenario, quick, progress, Evaluator(scenario, on_run=on_run)))
    for b in benches:
        b.evaluator.on_run = on_run
    best_fixed = best_single_fixed(benches, quick=quick, progress=progress)
    total_req = sum(b.evaluator.requests_simulated for b in benches)
    total_s = sum(b.evaluator.sim_seconds for b in benches)
    notes = [] if engine_available() else ["pipeline.core.engine.BatchingEngine not importable: batchtide rows missing"]
    return SuiteResult(
        benches,
        [compare(b) for b in benches],
        best_fixed,
        default_worst(benches),
        total_req / total_s if total_s else 0.0,
        notes,
    )
