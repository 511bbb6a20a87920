"""run_isolating: a batch that raises is bisected; culprits get errors, the rest get outputs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from consumers.runners import make_runner, run_isolating
from consumers.runners.base import Output
from consumers.runners.cost_model import POISON_MARKER, ZeroCostRunner
from pipeline.core.config import ModelConfig
from schemas.messages import Request


class CountingRunner(ZeroCostRunner):
    """The zero-cost runner with its poison hook on, counting how often it runs."""

    def __init__(self) -> None:
        super().__init__(ModelConfig(name="sim", runner="zero-cost"), poison_marker=POISON_MARKER)
        self.runs = 0

    def run(self, reqs: list[Request]) -> list[Output]:
        self.runs += 1
        return super().run(reqs)


def _batch(n: int, poison_at: set[int]) -> list[Request]:
    return [
        Request(id=f"r{i}", model="sim", text=f"{POISON_MARKER} {i}" if i in poison_at else f"fine {i}")
        for i in range(n)
    ]


def test_clean_batch_runs_once() -> None:
    runner = CountingRunner()
    outputs, errors = run_isolating(runner, _batch(16, set()))
    assert sorted(outputs) == list(range(16)) and errors == {}
    assert runner.runs == 1


@pytest.mark.parametrize("poison_at", [{0}, {15}, {6}, {3, 11}, {7, 8}])
def test_poison_requests_are_isolated(poison_at: set[int]) -> None:
    runner = CountingRunner()
    outputs, errors = run_isolating(runner, _batch(16, poison_at))
    assert set(errors) == poison_at
    assert sorted(outputs) == sorted(set(range(16)) - poison_at)
    assert all("PoisonError" in text and "test hook" in text for text in errors.values())
    # k poison requests among n cost at most 1 + 2k*log2(n) runs
    assert runner.runs <= 1 + 2 * len(poison_at) * math.ceil(math.log2(16))


def test_outputs_keep_request_positions() -> None:
    runner = make_runner(ModelConfig(name="sim", runner="zero-cost", poison_marker=POISON_MARKER))
    reqs = _batch(5, {2})
    outputs, errors = run_isolating(runner, reqs)
    assert set(outputs) == {0, 1, 3, 4} and set(errors) == {2}


def test_wrong_output_count_counts_as_failure() -> None:
    class Short(ZeroCostRunner):
        def run(self, reqs: list[Request]) -> list[Output]:
            return super().run(reqs)[:-1] if len(reqs) > 1 else super().run(reqs)

    outputs, errors = run_isolating(Short(ModelConfig(name="sim", runner="zero-cost")), _batch(4, set()))
    assert sorted(outputs) == [0, 1, 2, 3] and errors == {}


@pytest.mark.model
def test_real_model_rejecting_an_input_is_isolated(tiny_bert_dir: Path) -> None:
    """A real failure, not a hook: token ids past the tiny BERT's vocabulary make
    its embedding lookup raise IndexError. check() would refuse it up front; here
    it reaches run() and bisection must still save the rest of the batch."""
    runner = make_runner(ModelConfig(name="tiny", model_path=str(tiny_bert_dir)))
    reqs = [Request(id=f"r{i}", model="tiny", text=f"kafka topic {i}") for i in range(16)]
    reqs[5] = Request(id="bad5", model="tiny", token_ids=[5, 6, 99_999])
    reqs[12] = Request(id="bad12", model="tiny", token_ids=[70_000])
    with pytest.raises(IndexError):
        runner.run(reqs)
    outputs, errors = run_isolating(runner, reqs)
    assert set(errors) == {5, 12}
    assert all(text.startswith("IndexError") for text in errors.values())
    assert sorted(outputs) == [i for i in range(16) if i not in (5, 12)]
    (alone,) = runner.run([reqs[0]])
    assert alone.embedding == pytest.approx(outputs[0].embedding, abs=1e-5)
