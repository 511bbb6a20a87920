"""Runners: what computes a batch. `make_runner` picks one from a model's config.

- `transformers`: a real model (see `transformers_runner`).
- `cost-model`: sleeps t(b) of the simulated device (pipeline/core/sim/device_curve.py); simulated.
- `zero-cost`: returns at once, to measure the pipeline itself; simulated.
"""

from __future__ import annotations

from pipeline.core.config import ModelConfig

from .base import Output, Runner, run_isolating
from .cost_model import CostModelRunner, ZeroCostRunner
from .in_process import make_runner


def serving_runner(model: ModelConfig) -> Runner:
    """The runner a consumer serves with: batches in child processes unless `isolation` says thread."""
    isolated = model.isolation == "process" or (model.isolation == "auto" and model.runner == "transformers")
    if not isolated:
        return make_runner(model)
    # imported here: a device process runs device_process.py as __main__, and importing this
    # package must not load a second copy of it there
    from .device_process import ProcessRunner

    return ProcessRunner(model, make_runner(model, weights=False), slots=model.profile.max_inflight_batches)


__all__ = ["CostModelRunner", "Output", "Runner", "ZeroCostRunner", "make_runner", "run_isolating", "serving_runner"]
