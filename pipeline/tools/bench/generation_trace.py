"""The generation bench on a production trace: the trace's arrivals and lengths, not a scenario's draws.

`bench generation --trace FILE` serves a slice of an LLM request trace (pipeline/core/sim/
generation/trace.py) with batchtide-default and the LLM servers' schedulers, each at its best
configuration (generation.py), on one simulated device. Each request asks for exactly its answer's
tokens, as `produce --trace` sends it, so the simulated slice and a live replay of it are the
same requests. Given only the file, it chooses the rest itself:

- the device: a profile file given with `--profile`; else this machine's measured profile of the
  shipped generating model (SmolLM2, as `batchtide demo` caches it, or the file `consume` loads
  for a model named smollm); else the generation scenarios' device (scenarios/generation/*.toml);
- the objectives, from that device and the slice's lengths (`default_objectives`): time to first
  token `TTFT_PREFILLS` x the lone prefill of the slice's 90th-percentile prompt, so a long prompt
  of a burst may wait for a few of its size ahead of it and a short one for many; time per output
  token `TPOT_STEPS` x a lone decode step, room for a running set of tens and for the prompts
  that ride its steps, not for a prefill that stalls it for seconds;
- the time scale: the trace's own rate overloads a small device for minutes at a time (its
  bursts) and a slow enough replay makes every system meet everything, so it is searched
  (`search_time_scale`: from 4x lighter than the scale at which the busiest minute's prefills alone
  would fill the device, or at which the trace's bursts of prompts could be prefilled within the TTFT
  objective, whichever is heavier; by steps to a bracket, then bisection in log scale) for the load
  at which the best tuned peer meets both objectives for `ATTAINMENT` of the requests: a load where
  scheduling decides.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.config import ModelConfig
from pipeline.core.profile_file import DeviceProfile, ProfileError, load_profile
from pipeline.core.sim.generation.cost import GenerationCost
from pipeline.core.sim.generation.peer_schedulers import Kernels
from pipeline.core.sim.generation.trace import Trace, TraceSlice, read_trace, trace_arrivals
from pipeline.tools.bench.generation import GenRow, GenWorkload, bench_workload, best_peers, figures

DEFAULT_CURVE = GenerationCost.linear(10.0, 0.12, 20.0, 0.15, per_row_token_ms=0.00002)
"""The generation scenarios' device (scenarios/generation/*.toml): prefill 10 + 0.12 ms per token,
a decode step 20 + 0.15 ms per row, attention 0.00002 ms per row and cache token."""
DEFAULT_KV_TOKENS = 60_000
"""The generation scenarios' KV cache, and a profile's when it measured no memory limit."""
TTFT_PREFILLS = 5.0
TPOT_STEPS = 5.0
ATTAINMENT = (0.80, 0.95)
"""The share of requests the best tuned peer should meet both objectives for at the chosen scale."""
SEARCH_STEPS = 12
"""Most time scales tried by the search."""
SCALE_RANGE = (1.0 / 64.0, 1024.0)
LIGHT_START = 4.0
"""The search starts this much lighter than the heavier of `busiest_prefill_load` and `burst_prefill_scale`,
and goes `HEAVIER_STEP` heavier a step until too heavy: a run at an overload is by far the slowest to
simulate (queues of hundreds, every scheduler scanning them each iteration; one grid on a 2,000-request
synthetic conversation trace at the busiest minute's prefill load took over 5 minutes)."""
HEAVIER_STEP = 2.0


@dataclass(frozen=True)
class TraceDevice:
    cost: GenerationCost
    kv_tokens: int
    source: str
    """Where the curves came from, for the report."""
    profile: DeviceProfile | None = None


def _generation_profile(path: Path) -> DeviceProfile | None:
    try:
        found = load_profile(path)
    except (OSError, ProfileError):
        return None
    return found if found.generation is not None else None


def device_from_profile(found: DeviceProfile, source: str) -> TraceDevice:
    assert found.generation is not None
    raw = json.loads(Path(source).read_text()) if os.path.isfile(source) else {}
    kv = ((raw.get("memory") or {}).get("limit_units")) or DEFAULT_KV_TOKENS
    return TraceDevice(GenerationCost.from_curves(found.generation), int(kv), f"profile {source}", found)


def find_device(explicit: Path | None, cached: list[Path]) -> TraceDevice:
    """The device to simulate: `explicit`, else the first generation profile of `cached` (this machine's
    profiles of the shipped model), else the default curve."""
    if explicit is not None:
        found = load_profile(explicit)
        if found.generation is None:
            raise ProfileError(f"{explicit}: not a generation profile (no prefill and decode-step curves)")
        return device_from_profile(found, str(explicit))
    for path in cached:
        if path.is_file():
            cached_profile = _generation_profile(path)
            if cached_profile is not None:
                return device_from_profile(cached_profile, str(path))
    return TraceDevice(DEFAULT_CURVE, DEFAULT_KV_TOKENS, "default curve (the generation scenarios' device)")


def default_objectives(device: GenerationCost, sliced: Trace) -> tuple[float, float]:
    """(TTFT ms, TPOT ms): TTFT_PREFILLS lone prefills of the 90th-percentile prompt, TPOT_STEPS lone
    decode steps at the median prompt's cache."""
    p90 = int(np.percentile(sliced.prompt, 90))
    median = int(np.median(sliced.prompt + sliced.answer))
    return TTFT_PREFILLS * device.prefill_ms(1, p90), TPOT_STEPS * device.step_ms(1, median)


def trace_workload(sliced: Trace, device: TraceDevice, ttft_ms: float, tpot_ms: float, name: str) -> GenWorkload:
    """The slice as the bench's workload; batchtide-default's model admits its longest prompt and answer."""
    longest, new = int(sliced.prompt.max()), int(sliced.answer.max())
    return GenWorkload(name, trace_arrivals(sliced), device.cost, ttft_ms, tpot_ms, new, device.kv_tokens, longest)


def configured_row(workload: GenWorkload, model: ModelConfig, device: DeviceProfile) -> GenRow:
    """The model as a consumer runs it with this config and profile (replay_generation.GenSetup: its
    engine, join rule, KV token cap and reservations), on the workload: the row to set beside a live
    replay of the slice into that consumer."""
    from pipeline.tools.bench.replay_generation import GenSetup, simulate_profile

    start = time.perf_counter()
    arr = workload.arrivals
    run = simulate_profile(GenSetup(model, device), model.profile, arr, workload.cost, arr.emits)
    return GenRow(
        f"batchtide ({model.name} as configured)",
        "config",
        runs=1,
        wall_s=time.perf_counter() - start,
        **figures(workload, run.outcome),
    )


BUSY_WINDOW_S = 60.0


def busiest_prefill_load(sliced: Trace, cost: GenerationCost) -> float:
    """The share of the busiest BUSY_WINDOW_S of the slice its prompts' lone prefills take: the time
    scale at which that window's prefills alone would fill the device. The search starts there (at
    least): the trace's own rate is an overload far from the scales that matter, and its runs are the
    slowest to simulate."""
    work = cost.prefill_ms(1, 1) + (sliced.prompt - 1) * cost.prompt_token_ms()
    start = sliced.offset_ms
    end = np.searchsorted(start, start + BUSY_WINDOW_S * 1000.0)
    total = np.concatenate([[0.0], np.cumsum(work)])
    return float(((total[end] - total[np.arange(len(start))]) / (BUSY_WINDOW_S * 1000.0)).max(initial=0.0))


def burst_prefill_scale(sliced: Trace, cost: GenerationCost, ttft_ms: float, share: float) -> float:
    """The least time scale at which, for `share` of the requests, the prompts arriving within a TTFT
    objective's time from it could all be prefilled, one after the other, within the objective (each
    prefill counted at most the objective). The trace's bursts decide where the scale lands (a burst
    of tens of long prompts must spread over enough time for their first tokens), so the search
    starts near it, instead of at a heavy load whose runs are the slowest to simulate."""
    work = np.minimum(cost.prefill_ms(1, 1) + (sliced.prompt - 1) * cost.prompt_token_ms(), ttft_ms)
    start = sliced.offset_ms
    total = np.concatenate([[0.0], np.cumsum(work)])
    at = np.arange(len(start))

    def fits(scale: float) -> bool:
        end = np.searchsorted(start, start + ttft_ms / scale, side="left")
        return bool(np.mean(total[end] - total[at] <= ttft_ms * (1.0 + 1e-9)) >= share)

    low, high = SCALE_RANGE
    if fits(low):
        return low
    if not fits(high):
        return high
    for _ in range(40):
        mid = math.sqrt(low * high)
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def best_peer(rows: list[GenRow]) -> GenRow:
    return max(rows, key=lambda r: r.goodput_rps)


@dataclass(frozen=True)
class ScaleSearch:
    scale: float
    attained: float
    """The best tuned peer's share of requests meeting both objectives at `scale` (the report's grids)."""
    tried: list[tuple[float, float]]
    peers: list[GenRow] | None = None
    """The peers' rows at `scale` (the report reuses them)."""


def search_time_scale(
    trace: Trace,
    window: TraceSlice,
    device: TraceDevice,
    objectives: Callable[[Trace], tuple[float, float]],
    quick: bool = False,
    on_step: Callable[[float, float], None] = lambda *_: None,
    peer_kernels: Kernels = "runner",
    jobs: int = 1,
    families: tuple[str, ...] = (),
) -> ScaleSearch:
    """The time scale at which the best tuned peer meets both objectives for ATTAINMENT of the requests
    (aiming at the middle), by steps to a bracket (lighter by 4x, heavier by HEAVIER_STEP) and bisecting in
    log scale, from LIGHT_START x the heavier of `busiest_prefill_load` and `burst_prefill_scale` (the TTFT
    objective does not depend on the scale). Less load never makes
    fewer requests meet their objectives here by more than noise, so the share falls with the load."""
    low, high = ATTAINMENT
    aim = (low + high) / 2.0
    tried: list[tuple[float, float]] = []
    rows: dict[float, list[GenRow]] = {}

    def attained(scale: float) -> float:
        sliced = replace(window, time_scale=scale).apply(trace)
        ttft, tpot = objectives(sliced)
        workload = trace_workload(sliced, device, ttft, tpot, "search")
        rows[scale] = best_peers(workload, quick, peer_kernels, jobs=jobs, only=families)
        got = best_peer(rows[scale]).attained
        tried.append((scale, got))
        on_step(scale, got)
        return got

    sliced = window.apply(trace)
    busiest = busiest_prefill_load(sliced, device.cost)
    heavy = max(busiest, burst_prefill_scale(sliced, device.cost, objectives(sliced)[0], aim))
    scale = max(window.time_scale, LIGHT_START * heavy)
    got = attained(scale)
    lo = hi = scale  # lo: too heavy (below `low`), hi: light enough (above `high`)
    while not (low <= got <= high) and len(tried) < SEARCH_STEPS:
        if got < low:
            lo = scale
            if hi <= scale:
                scale = min(scale * 4.0, SCALE_RANGE[1])
            else:
                scale = math.sqrt(lo * hi)
        else:
            hi = scale
            if lo >= scale:
                scale = max(scale / HEAVIER_STEP, SCALE_RANGE[0])
            else:
                scale = math.sqrt(lo * hi)
        if any(abs(math.log(scale / s)) < 1e-3 for s, _ in tried):
            break
        got = attained(scale)
    best = min(tried, key=lambda t: abs(t[1] - aim) if low <= t[1] <= high else 1.0 + abs(t[1] - aim))
    return ScaleSearch(best[0], best[1], tried, rows[best[0]])


def bench_trace(
    path: Path,
    window: TraceSlice,
    device: TraceDevice,
    ttft_ms: float | None,
    tpot_ms: float | None,
    quick: bool = False,
    search: bool = True,
    model: ModelConfig | None = None,
    say: Callable[[str], None] = lambda _: None,
    peer_kernels: Kernels = "runner",
    jobs: int = 1,
    families: tuple[str, ...] = (),
    give_up: tuple[bool, ...] = (True,),
) -> dict[str, Any]:
    """The trace's slice at the chosen (or searched) time scale: batchtide-default (a row for each of
    `give_up`: the early give-up on or off) and every peer's best (the grids' runs over `jobs`
    processes). With `model` (needs a profile device), a row of that model as configured is added
    after the peers."""
    if model is not None and device.profile is None:
        raise ProfileError("simulating a configured model needs its device profile (--profile)")
    trace = read_trace(path)

    def objectives(sliced: Trace) -> tuple[float, float]:
        ttft, tpot = default_objectives(device.cost, sliced)
        return (ttft_ms if ttft_ms is not None else ttft, tpot_ms if tpot_ms is not None else tpot)

    found: ScaleSearch | None = None
    if search:
        found = search_time_scale(
            trace,
            window,
            device,
            objectives,
            quick,
            on_step=lambda s, a: say(f"  time x{s:.3g}: the best tuned peer meets both objectives for {a:.1%}"),
            peer_kernels=peer_kernels,
            jobs=jobs,
            families=families,
        )
        window = replace(window, time_scale=found.scale)
        say(
            f"time scale chosen: x{found.scale:.3g} (the best tuned peer meets both objectives for {found.attained:.1%})"
        )
    sliced = window.apply(trace)
    ttft, tpot = objectives(sliced)
    workload = trace_workload(sliced, device, ttft, tpot, Path(path).name)
    report = bench_workload(
        workload,
        quick,
        peer_kernels=peer_kernels,
        jobs=jobs,
        peers=found.peers if found is not None else None,
        families=families,
        give_up=give_up,
    )
    rows = report["rows"]
    top = max(rows[report["batchtide_rows"] :], key=lambda r: r["goodput_rps"])
    if model is not None:
        assert device.profile is not None
        rows.append(asdict(configured_row(workload, model, device.profile)))
    report.update(
        {
            "trace": str(path),
            "window": {
                "start_s": window.start_s,
                "duration_s": window.duration_s,
                "time_scale": window.time_scale,
                "length_scale": window.length_scale,
                "answer_scale": window.answer_scale,
            },
            "time_scale": window.time_scale,
            "time_scale_searched": found is not None,
            "search": [{"time_scale": s, "best_peer_attained": a} for s, a in found.tried] if found else [],
            "best_peer": top["system"],
            "best_peer_attained": top["attained"],
            "device": device.source,
            "offered_rps": sliced.rate_per_s,
            "prompt_tokens_p50": float(np.median(sliced.prompt)),
            "answer_tokens_p50": float(np.median(sliced.answer)),
            "trace_indices": [int(sliced.index[0]), int(sliced.index[-1])],
        }
    )
    return report
