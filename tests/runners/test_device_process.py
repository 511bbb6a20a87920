"""ProcessRunner: batches in child processes give the in-process answers, and a dead child costs one batch."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Literal

import pytest

from consumers.runners import make_runner, run_isolating, serving_runner
from consumers.runners.cost_model import POISON_MARKER
from consumers.runners.device_process import DeviceProcessDied, ProcessRunner
from consumers.runners.transformers_runner import TransformersRunner
from pipeline.core.config import BatchProfile, ModelConfig
from schemas.messages import GenerationParams, Request

TEXTS = ["kafka", "the quick brown fox jumps over the lazy dog", "tail latency of a fixed window", "grafana"]


def _reqs(prefix: str, texts: list[str]) -> list[Request]:
    return [Request(id=f"{prefix}{i}", model="m", text=t) for i, t in enumerate(texts)]


def _process_runner(model: ModelConfig) -> ProcessRunner:
    runner = serving_runner(model)
    assert isinstance(runner, ProcessRunner)
    return runner


def _children(runner: ProcessRunner) -> list[int]:
    return [child.process.pid for child in runner._children]


@pytest.mark.model
def test_isolation_setting_picks_the_runner(tiny_bert_dir: Path) -> None:
    real = ModelConfig(name="m", model_path=str(tiny_bert_dir))
    assert isinstance(serving_runner(real), ProcessRunner)
    assert not isinstance(
        serving_runner(ModelConfig(name="m", model_path=str(tiny_bert_dir), isolation="thread")), ProcessRunner
    )
    assert not isinstance(serving_runner(ModelConfig(name="m", runner="zero-cost")), ProcessRunner)
    assert isinstance(serving_runner(ModelConfig(name="m", runner="zero-cost", isolation="process")), ProcessRunner)


@pytest.mark.model
def test_child_answers_equal_in_process_answers(tiny_bert_dir: Path) -> None:
    model = ModelConfig(name="m", model_path=str(tiny_bert_dir), torch_threads=1)
    local = make_runner(model)
    runner = _process_runner(model)
    try:
        runner.load()
        reqs = _reqs("a", TEXTS)
        assert all(runner.check(r) is None for r in reqs)
        remote = runner.run(reqs)
        here = local.run(_reqs("a", TEXTS))
        assert len(remote) == len(here) == len(TEXTS)
        for a, b in zip(remote, here, strict=True):
            assert a.embedding is not None and b.embedding is not None
            assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding, strict=True)) < 1e-6
        rss, kind = runner.device_memory()
        (pid,) = _children(runner)
        assert kind == "process_rss" and rss > 0 and pid != os.getpid()
        # the front never loaded weights: it validates, the child computes
        assert isinstance(runner._front, TransformersRunner) and runner._front._model is None
    finally:
        runner.close()


def test_runner_errors_come_back_and_bisect_to_the_culprit() -> None:
    runner = _process_runner(
        ModelConfig(name="m", runner="zero-cost", isolation="process", poison_marker=POISON_MARKER)
    )
    try:
        reqs = _reqs("p", ["fine", f"{POISON_MARKER} here", "fine too", "and this"])
        outputs, errors = run_isolating(runner, reqs)
        assert sorted(outputs) == [0, 2, 3]
        assert set(errors) == {1} and "PoisonError" in errors[1]
    finally:
        runner.close()


def test_a_killed_child_fails_its_batch_and_the_next_batch_gets_a_fresh_child() -> None:
    runner = _process_runner(
        ModelConfig(name="m", runner="cost-model", isolation="process", cost_a_ms=3000.0, cost_c_ms=0.0)
    )
    try:
        runner.load()
        (first,) = _children(runner)
        outcome: list[BaseException | None] = []

        def run_one() -> None:
            try:
                runner.run(_reqs("k", ["slow"]))
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        worker = threading.Thread(target=run_one)
        worker.start()
        time.sleep(0.5)
        os.kill(first, signal.SIGKILL)
        worker.join(timeout=30)
        assert len(outcome) == 1 and isinstance(outcome[0], DeviceProcessDied)
        assert "exited with code" in str(outcome[0])

        runner._model = ModelConfig(name="m", runner="zero-cost", isolation="process")  # no 3 s sleep in the next child
        (out,) = runner.run(_reqs("n", ["after the crash"]))
        assert out.text == "[simulated]"
        (second,) = _children(runner)
        assert second != first
    finally:
        runner.close()


def test_close_stops_every_child() -> None:
    runner = _process_runner(ModelConfig(name="m", runner="zero-cost", isolation="process"))
    runner.load()
    children = list(runner._children)
    runner.close()
    assert children and all(child.process.poll() is not None for child in children)


def test_one_child_per_inflight_slot_and_concurrent_batches() -> None:
    slots = 2
    model = ModelConfig(
        name="m",
        runner="cost-model",
        isolation="process",
        cost_a_ms=800.0,
        cost_c_ms=0.0,
        profile=BatchProfile(max_inflight_batches=slots),
    )
    runner = _process_runner(model)
    try:
        runner.load()
        assert len(set(_children(runner))) == slots
        start = time.perf_counter()
        runner.run(_reqs("alone-", ["x"]))
        alone = time.perf_counter() - start
        threads = [threading.Thread(target=runner.run, args=(_reqs(f"c{i}-", ["x"]),)) for i in range(slots)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        together = time.perf_counter() - start
        # two batches in two children overlap: about the time of one batch alone (measured here, so a
        # loaded machine slows both alike), where one after the other would take twice it
        assert alone >= 0.8 and together < 1.5 * alone, (alone, together)
    finally:
        runner.close()


@pytest.mark.model
@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_decode_loop_reports_each_plain_step_it_timed_once(
    tiny_gpt2_dir: Path, isolation: Literal["thread", "process"]
) -> None:
    """Iteration-level batching: the consumer's balance learns its pace from the decode loop's timed
    steps (rows, ms) as they run, in its device process or in this one; each step comes once."""
    model = ModelConfig(
        name="g", model_path=str(tiny_gpt2_dir), torch_threads=1, batching="iteration", isolation=isolation
    )
    runner = serving_runner(model)
    timed = runner.timed_steps  # type: ignore[attr-defined]
    try:
        runner.load()
        params = GenerationParams(max_new_tokens=9, ignore_eos=True)
        reqs = [Request(id=f"s{i}", model="g", text=t, params=params) for i, t in enumerate([TEXTS[0], TEXTS[3]])]
        outs = runner.run(reqs)
        assert [o.tokens_out for o in outs] == [9, 9]
        steps: list[tuple[int, float]] = []
        deadline = time.monotonic() + 5.0
        while len(steps) < 8 and time.monotonic() < deadline:
            steps += timed()
            time.sleep(0.02)
        assert len(steps) == 8, "one prefill, then eight plain steps of both rows"
        assert all(rows == 2 and ms > 0 for rows, ms in steps)
        time.sleep(0.2)
        assert timed() == [], "taken once"
    finally:
        runner.close()
