"""The policy families of the bench: how to build each one, and the grid of its own knobs.

Every family is searched over its own knobs, caps included, by the same rule
(pipeline/core/sim/search.py). A scenario's device memory limit (`[cost] max_batch`)
bounds every cap: grid points above it are replaced by the limit itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.core.config import BatchProfile
from pipeline.core.engine.decisions import BatchPolicy
from pipeline.core.sim.peers import (
    BentoAdaptive,
    ClipperAIMD,
    FixedWindow,
    PollTimerBatcher,
    TFServingBasic,
    TritonDynamic,
)
from pipeline.core.sim.scenario import Scenario

Config = dict[str, Any]

DEFAULT_DEVICE_CAP = 128
"""A scenario's device memory limit when `[cost] max_batch` is absent."""


@dataclass(frozen=True)
class LaneContext:
    """Deployment facts a policy is built with (not tuning): devices behind its queue, priority levels."""

    max_inflight: int
    priority_levels: int
    device_cap: int = DEFAULT_DEVICE_CAP
    """The device memory limit (`[cost] max_batch`, 128 when absent): batchtide's
    `hard_cap = "auto"` ceiling, the same one every family's grid reaches."""
    prior_costs: tuple[tuple[int, float], ...] = ()
    """The device profile a consumer loads at start (t(b) measured before the run)."""
    slo_p99_ms: float | None = None
    """The scenario's SLO when its requests carry deadlines: an operator whose clients send
    deadlines states the objective batchtide sheds by (`slo_p99_ms`); None keeps the profile's."""


Builder = Callable[[Config, LaneContext], BatchPolicy]


@dataclass(frozen=True)
class Family:
    name: str
    build: Builder
    grid: tuple[Config, ...]
    quick_grid: tuple[Config, ...]
    cap_key: str | None = None
    """Config key holding the batch cap (clipped to the device memory limit)."""

    def configs(self, scenario: Scenario, quick: bool) -> list[Config]:
        raw = self.quick_grid if quick else self.grid
        limit = scenario.cost.max_batch
        out: list[Config] = []
        for cfg in raw:
            if limit is not None and self.cap_key and cfg[self.cap_key] > limit:
                cfg = {**cfg, self.cap_key: limit}
                if self.name == "batchtide":
                    cfg["target_size"] = min(cfg["target_size"], limit)
            if cfg not in out:
                out.append(cfg)
        return out


def _grid(**axes: tuple[Any, ...]) -> tuple[Config, ...]:
    configs: list[Config] = [{}]
    for key, values in axes.items():
        configs = [{**c, key: v} for c in configs for v in values]
    return tuple(configs)


def engine_available() -> bool:
    try:
        from pipeline.core.engine import BatchingEngine  # noqa: F401
    except ImportError:
        return False
    return True


def build_engine(profile: BatchProfile, ctx: LaneContext) -> BatchPolicy:
    from pipeline.core.engine import BatchingEngine

    if profile.max_inflight_batches != ctx.max_inflight:
        profile = profile.replace(max_inflight_batches=ctx.max_inflight)
    if ctx.slo_p99_ms is not None:
        profile = profile.replace(slo_p99_ms=ctx.slo_p99_ms)
    return BatchingEngine(profile, device_cap=ctx.device_cap, prior_costs=ctx.prior_costs)


def _batchtide(cfg: Config, ctx: LaneContext) -> BatchPolicy:
    return build_engine(BatchProfile(**cfg), ctx)


CAPS = (8, 16, 32, 48, 64, 128)
QUICK_CAPS = (8, 32, 128)

FIXED_WINDOW = Family(
    "fixed-window",
    lambda c, x: FixedWindow(c["window_ms"], c["cap"], x.max_inflight),
    _grid(window_ms=(0.0, 2.0, 5.0, 20.0, 50.0), cap=(4, 8, 16, 24, 32, 48, 64, 96, 128)),
    _grid(window_ms=(0.0, 5.0, 20.0), cap=QUICK_CAPS),
    cap_key="cap",
)

TRITON = Family(
    "triton",
    lambda c, x: TritonDynamic(
        c["max_batch_size"],
        c["max_queue_delay_ms"],
        (c["max_batch_size"] // 2, c["max_batch_size"]) if c["preferred"] else (),
        x.priority_levels,
        x.max_inflight,
    ),
    _grid(max_batch_size=CAPS, max_queue_delay_ms=(0.0, 2.0, 10.0), preferred=(False, True)),
    _grid(max_batch_size=QUICK_CAPS, max_queue_delay_ms=(0.0, 10.0), preferred=(False,)),
    cap_key="max_batch_size",
)


def _cap_and_wait(
    name: str,
    peer: Callable[[int, float, int], BatchPolicy],
    cap_key: str,
    wait_key: str,
    waits: tuple[float, ...],
    quick_waits: tuple[float, ...],
    wait_to_ms: float = 1.0,
) -> Family:
    """A peer whose only knobs are a batch cap and one wait (in its own unit): the cap spans the shared CAPS."""
    return Family(
        name,
        lambda c, x: peer(c[cap_key], c[wait_key] * wait_to_ms, x.max_inflight),
        _grid(**{cap_key: CAPS, wait_key: waits}),
        _grid(**{cap_key: QUICK_CAPS, wait_key: quick_waits}),
        cap_key=cap_key,
    )


TF_SERVING = _cap_and_wait(
    "tf-serving", TFServingBasic, "max_batch_size", "batch_timeout_ms", (0.0, 2.0, 10.0, 50.0), (0.0, 10.0)
)
TORCHSERVE = _cap_and_wait(
    "torchserve", PollTimerBatcher, "batch_size", "max_batch_delay_ms", (0.0, 2.0, 10.0, 50.0), (0.0, 10.0)
)
RAY_SERVE = _cap_and_wait(
    "ray-serve",
    PollTimerBatcher,
    "max_batch_size",
    "batch_wait_timeout_s",
    (0.0, 0.001, 0.01, 0.05),
    (0.0, 0.01),
    wait_to_ms=1000.0,
)
BENTOML = _cap_and_wait(
    "bentoml", BentoAdaptive, "max_batch_size", "max_latency_ms", (500.0, 1000.0, 2000.0, 10000.0), (1000.0, 10000.0)
)

CLIPPER = Family(
    "clipper",
    lambda c, x: ClipperAIMD(c["batch_slo_ms"], c["step"], c["cap"], x.max_inflight),
    _grid(batch_slo_ms=(10.0, 20.0, 40.0, 80.0), step=(1, 4), cap=(16, 48, 128)),
    _grid(batch_slo_ms=(10.0, 40.0), step=(4,), cap=(48, 128)),
    cap_key="cap",
)

BATCHTIDE = Family(
    "batchtide",
    _batchtide,
    tuple(
        {"target_size": t, "hard_cap": c, "max_wait_ms": w}
        for t, c in ((8, 12), (16, 24), (32, 48), (48, 64), (64, 96), (96, 128))
        for w in (2.0, 20.0)
    ),
    tuple({"target_size": t, "hard_cap": c, "max_wait_ms": 20.0} for t, c in ((8, 12), (32, 48), (96, 128))),
    cap_key="hard_cap",
)

PEER_FAMILIES = (FIXED_WINDOW, TRITON, TF_SERVING, TORCHSERVE, RAY_SERVE, BENTOML, CLIPPER)

SEED_BASELINE: Config = {"window_ms": 20.0, "cap": 48}
"""The field report's own static configuration: fixed 20 ms wait, cap 48, no marking."""


def families() -> tuple[Family, ...]:
    """Every searched family; batchtide's only when the engine is importable."""
    return PEER_FAMILIES + ((BATCHTIDE,) if engine_available() else ())


def default_profile_config() -> Config:
    """batchtide-default: BatchProfile() untouched (shown in the report as its field values)."""
    return {f.name: getattr(BatchProfile(), f.name) for f in dataclasses.fields(BatchProfile)}


def _default(cfg: Config, ctx: LaneContext) -> BatchPolicy:
    return build_engine(BatchProfile(), ctx)


def _default_nomark(cfg: Config, ctx: LaneContext) -> BatchPolicy:
    return build_engine(BatchProfile(tail_mark_ratio=0.0), ctx)


def builder(name: str) -> Builder:
    """The builder of a family or fixed row, by its row name."""
    fixed: dict[str, Builder] = {
        "batchtide-default": _default,
        "batchtide-nomark": _default_nomark,
        "seed-baseline": FIXED_WINDOW.build,
    }
    if name in fixed:
        return fixed[name]
    for family in (*PEER_FAMILIES, BATCHTIDE):
        if family.name == name:
            return family.build
    raise KeyError(f"unknown policy family {name!r}")
