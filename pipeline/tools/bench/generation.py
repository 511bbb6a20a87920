"""The generation bench: batchtide's engine and decode loop against LLM servers' schedulers, by goodput.

On a generation scenario (pipeline/core/sim/generation/gen_scenario.py) every system runs the same
arrivals on the same simulated device. batchtide-default is untuned: the engine with the
layout `batchtide profile` recommends for that device (a batch is one request at the profiled
prompt of 32 tokens, the cap is the longest admissible request, the running set is the decode
curve's knee within the KV cache, 8 more batches wait to join), driving the consumer's decode
loop (decode_loop.py). Each peer is grid-searched over its own documented knobs and reported at its
best (its oracle for this scenario). Goodput is DistServe's and Sarathi-Serve's measure: answered
requests per second that met both the time-to-first-token and the time-per-output-token
objective (an answer of one token has no TPOT and needs only the first).
"""

from __future__ import annotations

import functools
import itertools
import math
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from pipeline.core.config import BatchProfile, ModelConfig
from pipeline.core.engine import BatchingEngine
from pipeline.core.sim.generation.cost import GenerationCost
from pipeline.core.sim.generation.decode_loop import (
    JOIN_SLOTS,
    GenArrivals,
    GenOutcome,
    LoopSettings,
    running_token_cap,
    simulate_generation,
)
from pipeline.core.sim.generation.gen_scenario import GenScenario, gen_arrivals
from pipeline.core.sim.generation.peer_schedulers import (
    TGI,
    VLLM,
    FixedWindowGen,
    Kernels,
    SGLang,
    TokenScheduler,
    simulate_tokens,
)

PROFILED_PROMPT = 32
"""Prompt tokens `batchtide profile` measures at by default (its --tokens)."""
PROFILED_MAX_ROWS = 256
"""Largest batch `batchtide profile` tries by default (its --max-size)."""
KNEE_TOLERANCE = 0.02


@dataclass(frozen=True)
class GenWorkload:
    """What every system of the bench serves: requests on one simulated device, under two objectives."""

    name: str
    arrivals: GenArrivals
    cost: GenerationCost
    ttft_ms: float
    tpot_ms: float
    max_new_tokens: int
    """The model's max_new_tokens: what batchtide's loop reserves per row, the longest answer."""
    kv_tokens: int
    longest_prompt: int
    """The longest prompt the model admits (its max_input_tokens)."""

    @classmethod
    def of_scenario(cls, scn: GenScenario) -> GenWorkload:
        prompt = scn.base.prompt
        longest = prompt.max if prompt.dist != "fixed" else prompt.value
        return cls(
            scn.name,
            gen_arrivals(scn),
            scn.cost,
            scn.ttft_ms,
            scn.tpot_ms,
            scn.max_new_tokens,
            scn.kv_tokens,
            int(longest),
        )


@dataclass(frozen=True)
class GenRow:
    system: str
    config: str
    goodput_rps: float
    throughput_rps: float
    generated_tokens_per_s: float
    """Tokens of the answers served, over the first request to the last answer."""
    attained: float
    """Share of all requests that met both objectives."""
    ttft_p99_ms: float
    tpot_p99_ms: float
    e2e_p99_ms: float
    expired_share: float
    longest_gap_ms: float
    """The longest wait between two tokens of one answer (a prefill that stalled the running set)."""
    ttft_late: int
    """Requests answered with a first token later than the TTFT objective."""
    given_up: int
    """Requests answered expired: given up on before their first token, or past their deadline. With
    `ttft_late` they are the TTFT misses."""
    runs: int
    wall_s: float


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def figures(scn: GenWorkload, outcome: GenOutcome) -> dict[str, Any]:
    """A run's row of the report (GenRow's measured fields)."""
    arr = outcome.arrivals
    served = ~outcome.expired & ~np.isnan(outcome.done_ms)
    ttft = outcome.first_ms - arr.create_ms
    many = arr.emits > 1
    tpot = np.where(many, (outcome.done_ms - outcome.first_ms) / np.maximum(arr.emits - 1, 1), 0.0)
    good = served & (ttft <= scn.ttft_ms) & (tpot <= scn.tpot_ms)
    span_s = max(1e-9, (float(np.nanmax(outcome.done_ms)) - float(arr.create_ms.min())) / 1000.0)
    return {
        "goodput_rps": float(good.sum()) / span_s,
        "throughput_rps": float(served.sum()) / span_s,
        "generated_tokens_per_s": float(np.minimum(arr.emits, arr.limit)[served].sum()) / span_s,
        "attained": float(good.mean()) if len(arr) else math.nan,
        "ttft_p99_ms": _pct(ttft[served], 99),
        "tpot_p99_ms": _pct(tpot[served & many], 99),
        "e2e_p99_ms": _pct((outcome.done_ms - arr.create_ms)[served], 99),
        "expired_share": float(outcome.expired.mean()) if len(arr) else 0.0,
        "longest_gap_ms": outcome.longest_gap_ms,
        "ttft_late": int((served & (ttft > scn.ttft_ms)).sum()),
        "given_up": int(outcome.expired.sum()),
    }


def knee_rows(scn: GenWorkload) -> int:
    """The decode curve's knee as `batchtide profile` finds it (doubling rows up to its max size)."""
    penalty = math.log(1.0 + KNEE_TOLERANCE) / math.log(2.0)
    best, best_score, rows = 1, -math.inf, 1
    while rows <= PROFILED_MAX_ROWS:
        ms = scn.cost.step_ms(rows, PROFILED_PROMPT)
        score = math.log(rows * 1000.0 / ms) - penalty * math.log(rows)
        if score > best_score + 1e-12:
            best, best_score = rows, score
        rows *= 2
    return best


def default_model(scn: GenWorkload, name: str = "generation") -> ModelConfig:
    """batchtide-default's model: one that admits the workload's longest prompt and answer, with the
    layout the profile file recommends for this device (measured_profile.build) and the workload's
    objectives as its SLOs; every other knob at its default. A live consumer configured with it is
    the consumer the simulated row stands for."""
    new = scn.max_new_tokens
    typical = PROFILED_PROMPT + new
    longest = scn.longest_prompt + new
    rows = max(1, min(knee_rows(scn), scn.kv_tokens // typical))
    profile = BatchProfile(
        cost_unit="tokens",
        hard_cap=longest,
        target_size=min(typical, longest),
        max_inflight_batches=rows + JOIN_SLOTS,
        slo_p99_ms=scn.ttft_ms,
        slo_ms_per_new_token=scn.tpot_ms,
    )
    return ModelConfig(
        name=name,
        task="generate",
        batching="iteration",
        max_input_tokens=scn.longest_prompt,
        max_new_tokens=new,
        profile=profile,
    )


def default_layout(scn: GenWorkload) -> tuple[BatchProfile, LoopSettings, int, list[tuple[int, float]]]:
    """batchtide-default: the profile file's recommended layout for this device and model, with
    every other knob at its default (measured_profile.build and profile_file.apply)."""
    model = default_model(scn)
    profile = model.profile
    new = model.max_new_tokens
    typical = PROFILED_PROMPT + new
    longest = scn.longest_prompt + new
    rows = profile.max_inflight_batches - JOIN_SLOTS
    loop = LoopSettings(
        token_cap=running_token_cap(longest, rows + JOIN_SLOTS, typical),
        step_budget_ms=profile.slo_ms_per_new_token,
        reserve_tokens=new,
        tpot_ms=scn.tpot_ms,
        step_token_budget=model.step_token_budget,
        ttft_ms=model.ttft_objective_ms,
    )
    profile = model.engine_profile()
    points = []
    b = 1
    while b <= rows:
        points.append(
            (b * typical, scn.cost.prefill_ms(b, PROFILED_PROMPT) + new * scn.cost.step_ms(b, PROFILED_PROMPT))
        )
        b *= 2
    return profile, loop, longest, [(x, ms) for x, ms in points if x <= longest]


def run_default(scn: GenWorkload, arr: GenArrivals, give_up: bool = True) -> GenOutcome:
    """batchtide-default on `arr`. Without `give_up` the loop knows no TTFT objective, as a model whose
    shed_when is not "slo" runs: a waiting request whose first token can no longer meet it is still
    served (joins.late_for_first_token off), and a prefill late on rides is not rescued either."""
    profile, loop, cap, points = default_layout(scn)
    if not give_up:
        loop = replace(loop, ttft_ms=None)
    engine = BatchingEngine(profile, device_cap=cap, prior_costs=points)
    return simulate_generation(arr, scn.cost, [engine], loop, profile.max_inflight_batches)


DEFAULT_SYSTEM = "batchtide-default"

PEER_FAMILIES = ("vllm", "tgi", "sglang", "fixed-window")
"""The peers' schedulers, in the report's order (`grids`)."""

Grid = list[tuple[str, Callable[[], TokenScheduler]]]
"""A family's settings to try: each one's description and a maker of its scheduler."""


def grids(scn: GenWorkload, quick: bool) -> dict[str, Grid]:
    """Each peer's knobs (as documented), a coarser grid with `quick`. Like the servers themselves,
    vLLM without chunked prefill and TGI need a prefill budget of at least the longest prompt."""
    kv = scn.kv_tokens
    longest = scn.longest_prompt
    # with one priority level vLLM's priority policy orders the queue as FCFS does (a preempted row,
    # admitted before every waiting one, arrived before them): its runs would repeat FCFS's
    policies = ("fcfs", "priority") if np.unique(scn.arrivals.priority).size > 1 else ("fcfs",)
    seqs = (32, 128, 512) if quick else (16, 32, 64, 128, 256, 512)
    budgets = (512, 2048, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
    vllm: Grid = [
        (
            f"max_num_seqs={s} max_num_batched_tokens={t} chunked={c} {p}",
            functools.partial(VLLM, s, t, c, p, kv),
        )
        for s, t, c, p in itertools.product(seqs, budgets, (True, False), policies)
        if c or t >= longest
    ]
    total = (kv // 2, kv) if quick else (kv // 4, kv // 2, kv)
    prefill = [b for b in ((2048, 4096) if quick else (512, 1024, 2048, 4096, 8192)) if b >= longest] or [longest]
    ratios = (0.3, 1.2) if quick else (0.3, 0.6, 1.2, 2.0)
    waits = (5, 20) if quick else (2, 5, 10, 20, 50)
    tgi: Grid = [
        (
            f"max_batch_total_tokens={a} max_batch_prefill_tokens={b} waiting_served_ratio={r} max_waiting_tokens={w}",
            functools.partial(TGI, a, b, r, w),
        )
        for a, b, r, w in itertools.product(total, prefill, ratios, waits)
    ]
    chunks = (512, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
    cons = (0.3, 1.0) if quick else (0.3, 0.6, 1.0, 1.3, 1.6)
    sglang: Grid = [
        (f"chunked_prefill_size={c} schedule_conservativeness={k}", functools.partial(SGLang, c, k, kv))
        for c, k in itertools.product(chunks, cons)
    ]
    windows = (0.0, 20.0) if quick else (0.0, 5.0, 20.0, 50.0, 100.0)
    caps = (16, 48) if quick else (8, 16, 32, 48, 64, 128)
    fixed: Grid = [
        (f"window={w:g} ms cap={c}", functools.partial(FixedWindowGen, w, c, kv))
        for w, c in itertools.product(windows, caps)
    ]
    return {"vllm": vllm, "tgi": tgi, "sglang": sglang, "fixed-window": fixed}


def bench_scenario(
    scn: GenScenario,
    quick: bool = False,
    on_run: Callable[[str], None] = lambda _: None,
    peer_kernels: Kernels = "runner",
    jobs: int = 1,
    families: tuple[str, ...] = (),
    give_up: tuple[bool, ...] = (True,),
) -> dict[str, Any]:
    """batchtide-default and every peer's best configuration on one scenario, the peers charged
    the runner's measured kernels (or their own idealised ragged ones: peer_schedulers.iteration_ms)."""
    return bench_workload(
        GenWorkload.of_scenario(scn), quick, on_run, peer_kernels, jobs, families=families, give_up=give_up
    )


_POOL_WORKLOAD: tuple[GenWorkload, Kernels] | None = None


def _pool_start(workload: GenWorkload, kernels: Kernels) -> None:
    global _POOL_WORKLOAD
    _POOL_WORKLOAD = (workload, kernels)


def _pool_run(make: Callable[[], TokenScheduler]) -> tuple[dict[str, Any], float]:
    assert _POOL_WORKLOAD is not None
    scn, kernels = _POOL_WORKLOAD
    start = time.perf_counter()
    got = figures(scn, simulate_tokens(scn.arrivals, scn.cost, make(), kernels))
    return got, time.perf_counter() - start


def _grid_figures(
    scn: GenWorkload, runs: list[Callable[[], TokenScheduler]], peer_kernels: Kernels, jobs: int
) -> list[tuple[dict[str, Any], float]]:
    """Each run's figures and seconds, in `jobs` processes (the runs are independent and pure)."""
    if jobs <= 1:
        _pool_start(scn, peer_kernels)
        return [_pool_run(make) for make in runs]
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_pool_start, initargs=(scn, peer_kernels)) as pool:
        return list(pool.map(_pool_run, runs))


def best_peers(
    scn: GenWorkload,
    quick: bool = False,
    peer_kernels: Kernels = "runner",
    on_run: Callable[[str], None] = lambda _: None,
    jobs: int = 1,
    only: tuple[str, ...] = (),
) -> list[GenRow]:
    """Each peer family (of `only`, when given: a bench split over several runs) at the configuration
    of its grid with the highest goodput (its oracle); the grids' runs spread over `jobs` processes
    (the same rows as one: the first best in grid order)."""
    families = {name: grid for name, grid in grids(scn, quick).items() if not only or name in only}
    runs = [(family, label, make) for family, grid in families.items() for label, make in grid]
    results = _grid_figures(scn, [make for _, _, make in runs], peer_kernels, jobs)
    rows = []
    for family, grid in families.items():
        best: tuple[str, dict[str, Any]] | None = None
        seconds = 0.0
        for (owner, label, _), (got, took) in zip(runs, results, strict=True):
            if owner != family:
                continue
            seconds += took
            if best is None or got["goodput_rps"] > best[1]["goodput_rps"] + 1e-9:
                best = (label, got)
        assert best is not None
        rows.append(GenRow(f"{family} (oracle)", best[0], runs=len(grid), wall_s=seconds, **best[1]))
        on_run(family)
    return rows


def bench_workload(
    scn: GenWorkload,
    quick: bool = False,
    on_run: Callable[[str], None] = lambda _: None,
    peer_kernels: Kernels = "runner",
    jobs: int = 1,
    peers: list[GenRow] | None = None,
    families: tuple[str, ...] = (),
    give_up: tuple[bool, ...] = (True,),
) -> dict[str, Any]:
    """batchtide-default and every peer's best configuration on one workload (`peers`: those rows
    already computed on this workload, by a search that ended on it; `families`: only those peers;
    `give_up`: a batchtide-default row with the early give-up on, off, or both, in that order)."""
    arr = scn.arrivals
    rows: list[GenRow] = []
    for on in give_up:
        start = time.perf_counter()
        out = figures(scn, run_default(scn, arr, on))
        system = DEFAULT_SYSTEM if on else f"{DEFAULT_SYSTEM}, give-up off"
        rows.append(GenRow(system, "profile layout", runs=1, wall_s=time.perf_counter() - start, **out))
        on_run(system)
    ours = rows[0]
    rows += peers if peers is not None else best_peers(scn, quick, peer_kernels, on_run, jobs, families)
    goodputs = [r.goodput_rps for r in rows[len(give_up) :]]
    top = max(goodputs) if goodputs else math.nan
    return {
        "scenario": scn.name,
        "requests": len(arr),
        "peer_kernels": peer_kernels,
        "ttft_ms": scn.ttft_ms,
        "tpot_ms": scn.tpot_ms,
        "rows": [asdict(r) for r in rows],
        "default_vs_best_peer": ours.goodput_rps / top if top > 0 else math.nan,
        "batchtide_rows": len(give_up),
    }
