"""Runners: what computes a batch. `make_runner` picks one from a model's config.

- `transformers`: a real model (see `transformers_runner`).
- `cost-model`: sleeps t(b) of the simulated device (pipeline/sim/device.py); simulated.
- `zero-cost`: returns at once, to measure the pipeline itself; simulated.
"""

from __future__ import annotations

from pipeline.config import ModelConfig

from .base import Output, Runner, run_isolating
from .cost_model import CostModelRunner, ZeroCostRunner


def make_runner(model: ModelConfig, *, weights: bool = True) -> Runner:
    """The runner `model.runner` names, in this process, not yet loaded (call `load()`).

    `weights=False` gives a transformers runner that loads only its tokenizer
    and limits: the front a `ProcessRunner` validates with.
    """
    if model.runner == "transformers":
        from .transformers_runner import TransformersRunner

        return TransformersRunner(model, weights=weights)
    if model.runner == "cost-model":
        return CostModelRunner(model, poison_marker=model.poison_marker)
    if model.runner == "zero-cost":
        return ZeroCostRunner(model, poison_marker=model.poison_marker)
    raise ValueError(f"model {model.name!r}: unknown runner {model.runner!r}")


def serving_runner(model: ModelConfig) -> Runner:
    """The runner a consumer serves with: batches in child processes unless `isolation` says thread."""
    isolated = model.isolation == "process" or (model.isolation == "auto" and model.runner == "transformers")
    if not isolated:
        return make_runner(model)
    from .device_process import ProcessRunner

    return ProcessRunner(model, make_runner(model, weights=False), slots=model.profile.max_inflight_batches)


__all__ = ["CostModelRunner", "Output", "Runner", "ZeroCostRunner", "make_runner", "run_isolating", "serving_runner"]
