"""`make_runner`: the runner a model's config names, built in this process.

Its own module so that a device process (device_process.py), which builds its
runner the same way, needs nothing from the package that starts it.
"""

from __future__ import annotations

from pipeline.core.config import ModelConfig

from .base import Runner
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
