"""The fleet bench: one consumer group per scenario, balanced or not, against the ideal group.

Three runs on the same arrivals (the same record times; the ideal run's keys
spread evenly): `off` is today (Kafka's equal partition counts, no
forwarding), `on` adds group-relative forwarding (pipeline/core/engine/peer_forwarding.py),
`ideal` is the group with every device fast and keys even. The ratios to
the ideal run are what issue 24's goals are stated in.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from pipeline.core.sim.arrivals import make_arrivals
from pipeline.core.sim.consumer_group import fleet_variant, simulate_fleet
from pipeline.core.sim.fleetmetrics import measure_fleet
from pipeline.core.sim.scenario import Scenario, ScenarioError
from pipeline.core.sim.scenario_file import load_scenario

VARIANTS = ("off", "on", "weighted", "weighted+on", "ideal")


def fleet_scenario(path: str | Path) -> Scenario:
    """A scenario file with a [fleet] table (others belong to `bench policies`)."""
    scenario = load_scenario(path)
    if scenario.fleet is None:
        raise ScenarioError(
            f"{path}: no [fleet] table: `bench fleet` studies a consumer group "
            "(see docs/benchmarks.md); use `bench policies` for this scenario"
        )
    return scenario


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def bench_fleet(scenario: Scenario) -> dict[str, Any]:
    """The three runs of one scenario and their ratios, as JSON-ready data."""
    fleet = scenario.fleet
    assert fleet is not None
    runs: dict[str, Any] = {}
    simulated = 0
    wall = 0.0
    for variant in VARIANTS:
        s = fleet_variant(scenario, variant)
        arrivals = make_arrivals(s)
        t0 = time.perf_counter()
        outcome = simulate_fleet(s, arrivals)
        wall += time.perf_counter() - t0
        simulated += len(arrivals)
        runs[variant] = measure_fleet(s, outcome).as_dict()
    ideal = runs["ideal"]["p99_ms"]
    return {
        "scenario": scenario.name,
        "source": scenario.source,
        "description": scenario.description,
        "consumers": scenario.topology.consumers,
        "partitions": fleet.partitions,
        "rate_per_s": scenario.mean_rate_per_s,
        "duration_s": scenario.duration_ms / 1000.0,
        "stragglers": [c for c in range(scenario.topology.consumers) if fleet.steady_factor(c) != 1.0],
        "runs": runs,
        "ratios": {
            "off_p99_vs_ideal": _ratio(runs["off"]["p99_ms"], ideal),
            "on_p99_vs_ideal": _ratio(runs["on"]["p99_ms"], ideal),
            "on_p99_vs_off": _ratio(runs["on"]["p99_ms"], runs["off"]["p99_ms"]),
            "on_recovered_p99_vs_ideal": _ratio(runs["on"]["recovered_p99_ms"], ideal),
        },
        "simulator_requests_per_s": simulated / wall if wall > 0 else None,
    }
