"""Goodput where requests carry deadlines: batchtide-default against every family's best.

When not everyone can be served in time, capacity at SLO says little (every
policy fails the p99 test in overload); what counts is how many requests are
answered within the SLO. For a scenario with `deadline_ms` this runs every
family's grid at the nominal load and at two overloads on the load ladder
(x1.49 and x2.0, `GOODPUT_LOADS`), keeps each family's best goodput per load
(its oracle: a different config may win at each load), and compares
batchtide-default, untuned, with the best of them (target: at least
`GOODPUT_TARGET` x).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.core.sim.families import default_profile_config, families
from pipeline.core.sim.scenario import Scenario
from pipeline.core.sim.search import Candidate, Evaluator, multiplier

GOODPUT_LOADS = (0, 20, 35)
"""Load ladder indices (pipeline/core/sim/search.py): x1.0, x1.49, x2.0 the scenario's arrivals."""
GOODPUT_TARGET = 0.97

Progress = Callable[[str], None]


def goodput_table(
    ev: Evaluator, scenario: Scenario, quick: bool, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """One row per load: batchtide-default's goodput, each family's best, and the ratio to the
    best peer (batchtide's own searched family is shown but is no peer)."""
    if scenario.deadline_ms is None:
        return []
    rows = []
    default = Candidate("batchtide-default", default_profile_config())
    for k in GOODPUT_LOADS:
        if progress:
            progress(f"{scenario.name}: goodput at x{multiplier(k):.2f}")
        mine = ev.at_load(default, k)
        best: dict[str, dict[str, Any]] = {}
        for family in families():
            for cfg in family.configs(scenario, quick):
                m = ev.at_load(Candidate(family.name, cfg), k)
                if family.name not in best or m.goodput_rps > best[family.name]["goodput_rps"]:
                    best[family.name] = {"config": cfg, "goodput_rps": m.goodput_rps, "good_share": m.good_share}
        peers = {name: row for name, row in best.items() if name != "batchtide"}
        top = max(peers, key=lambda name: peers[name]["goodput_rps"])
        top_rps = peers[top]["goodput_rps"]
        ratio = mine.goodput_rps / top_rps if top_rps > 0 else (1.0 if mine.goodput_rps == 0 else float("inf"))
        rows.append(
            {
                "load": round(multiplier(k), 3),
                "batchtide_default": {
                    "goodput_rps": mine.goodput_rps,
                    "good_share": mine.good_share,
                    "expired_share": mine.expired_share,
                    "p99_ms": mine.p99_ms,
                },
                "best_peer": {"policy": top, **peers[top]},
                "families": best,
                "ratio": ratio,
                "meets_target": ratio >= GOODPUT_TARGET,
            }
        )
    return rows
