"""Generation scenario files: a request scenario's arrivals, lengths and priorities, plus what
generating costs on the device and what its users ask of it (`[generation]`).

The arrival phases, bursts, `[tokens]` prompt and output distributions, `[priority]` mix and
`deadline_ms` read as in any scenario (scenario.py; documented in docs/benchmarks.md). The
output distribution is how many tokens each answer has (where its end-of-sequence falls);
every request asks for `max_new_tokens`. `[generation]`:

    ttft_ms = 2000            # objective: time to first token
    tpot_ms = 80              # objective: time per output token after the first
    max_new_tokens = 500      # what every request asks for (KV reservations, the longest request)
    kv_tokens = 60000         # KV cache of the device, in tokens
    prefill = { a_ms = 10, c_ms = 0.12 }     # ms over prompt tokens (or points = [[tokens, ms], ...])
    step = { a_ms = 20, c_ms = 0.15 }        # ms of a decode step over rows (or points)
    per_row_token_ms = 0.00002               # attention: ms per row and cache token
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.config import read_toml
from pipeline.core.sim.arrivals import (
    OUTPUT_STREAM,
    PRIORITY_STREAM,
    PROMPT_STREAM,
    arrival_times,
    categorical,
    stream_draws,
)
from pipeline.core.sim.device_curve import DeviceCurve
from pipeline.core.sim.generation.cost import GenerationCost
from pipeline.core.sim.generation.decode_loop import GenArrivals
from pipeline.core.sim.scenario import Scenario, ScenarioError
from pipeline.core.sim.scenario_file import number, parse_curve, parse_scenario


@dataclass(frozen=True)
class GenScenario:
    base: Scenario
    """Arrivals, lengths, priorities and deadline (its `[cost]` is not used)."""
    cost: GenerationCost
    ttft_ms: float
    tpot_ms: float
    max_new_tokens: int
    kv_tokens: int

    @property
    def name(self) -> str:
        return self.base.name


def parse_gen_scenario(data: dict[str, Any], source: str = "<scenario>") -> GenScenario:
    if "generation" not in data:
        raise ScenarioError(f"{source}: a generation scenario needs a [generation] table")
    raw = dict(data)
    gen = raw.pop("generation")
    if "cost" in raw:
        raise ScenarioError(f"{source}: a generation scenario's costs are [generation] prefill and step, not [cost]")
    raw["cost"] = {"a_ms": 1.0, "c_ms": 0.0}  # the request bench's t(b); generation charges its own
    base = parse_scenario(raw, source)
    where = f"{source} [generation]"
    known = {"ttft_ms", "tpot_ms", "max_new_tokens", "kv_tokens", "prefill", "step", "per_row_token_ms", "ref_cache"}
    unknown = sorted(set(gen) - known)
    if unknown:
        raise ScenarioError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    for key in ("prefill", "step"):
        if not isinstance(gen.get(key), dict):
            raise ScenarioError(f"{where}.{key}: expected a table (a_ms/c_ms or points)")
    prefill: DeviceCurve = parse_curve(f"{where}.prefill", gen["prefill"])
    step: DeviceCurve = parse_curve(f"{where}.step", gen["step"])
    cost = GenerationCost(
        prefill,
        step,
        number(where, gen, "ref_cache", default=0.0, minimum=0.0),
        number(where, gen, "per_row_token_ms", default=0.0, minimum=0.0),
    )
    max_new = int(number(where, gen, "max_new_tokens", positive=True))
    if (base.output.dist != "fixed" and base.output.max > max_new) or (
        base.output.dist == "fixed" and base.output.value > max_new
    ):
        raise ScenarioError(f"{where}.max_new_tokens: {max_new} is below the longest answer of [tokens.output]")
    return GenScenario(
        base=base,
        cost=cost,
        ttft_ms=number(where, gen, "ttft_ms", positive=True),
        tpot_ms=number(where, gen, "tpot_ms", positive=True),
        max_new_tokens=max_new,
        kv_tokens=int(number(where, gen, "kv_tokens", positive=True)),
    )


def load_gen_scenario(path: str | Path) -> GenScenario:
    return parse_gen_scenario(read_toml(path, ScenarioError, "scenario file"), str(Path(path)))


def gen_arrivals(scenario: GenScenario, multiplier: float = 1.0) -> GenArrivals:
    """One realisation at `multiplier` x the rates (common random numbers, as make_arrivals):
    request i keeps its prompt, answer length and priority at every load."""
    base = scenario.base
    create = arrival_times(base, multiplier)
    n = create.shape[0]
    prompt = np.maximum(stream_draws(base.seed, PROMPT_STREAM, n, base.prompt.sample), 1)
    emits = np.clip(stream_draws(base.seed, OUTPUT_STREAM, n, base.output.sample), 1, scenario.max_new_tokens)
    mix = np.asarray(base.priority_mix, dtype=float)
    priority = categorical(base.seed, PRIORITY_STREAM, n, mix) if len(mix) > 1 else np.zeros(n, dtype=np.int64)
    deadline = create + base.deadline_ms if base.deadline_ms is not None else np.full(n, np.nan)
    return GenArrivals(
        create,
        create.copy(),
        prompt,
        emits,
        np.full(n, scenario.max_new_tokens, dtype=np.int64),
        priority,
        np.zeros(n, dtype=np.int64),
        deadline,
    )
