"""Generation on a tiny real GPT-2: greedy decoding, early stops, iteration-level joins, refusals."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from consumers.runners import make_runner
from consumers.runners.decoding import RunningSet, Sequence
from consumers.runners.iteration import IterationScheduler
from consumers.runners.transformers_runner import TransformersRunner
from pipeline.core.config import BatchProfile, ModelConfig
from schemas.messages import GenerationParams, Request
from tests.support.models import with_stop_token

pytestmark = pytest.mark.model

PROMPTS = [
    "the quick brown fox",
    "kafka",
    "results go back to kafka and events go to",
    "tail latency grows when a fixed window waits too long",
    "grafana shows p99",
    "a hard cap keeps one burst",
]


def _gen(i: int, text: str, new: int, model: str = "g") -> Request:
    return Request(id=f"g{i}", model=model, text=text, params=GenerationParams(max_new_tokens=new))


def _runner(directory: Path, **fields: object) -> TransformersRunner:
    runner = make_runner(ModelConfig(name="g", model_path=str(directory), torch_threads=1, **fields))  # type: ignore[arg-type]
    assert isinstance(runner, TransformersRunner)
    runner.load()
    return runner


@pytest.fixture(scope="module")
def static(tiny_gpt2_dir: Path) -> TransformersRunner:
    return _runner(tiny_gpt2_dir, max_new_tokens=12)


def test_greedy_generation_repeats_itself(static: TransformersRunner) -> None:
    first = static.run([_gen(i, p, 12) for i, p in enumerate(PROMPTS)])
    second = static.run([_gen(10 + i, p, 12) for i, p in enumerate(reversed(PROMPTS))])
    assert [o.token_ids for o in first] == [o.token_ids for o in reversed(second)]
    assert all(o.tokens_out == 12 for o in first)  # the tiny model's EOS is rare: every row runs to its limit
    assert len({tuple(o.token_ids or ()) for o in first}) > 1


def test_first_token_time_is_stamped_at_prefill(static: TransformersRunner) -> None:
    import time

    before = time.time() * 1000.0
    outs = static.run([_gen(i, p, 12) for i, p in enumerate(PROMPTS)])
    after = time.time() * 1000.0
    stamps = {o.first_token_ms for o in outs}
    assert len(stamps) == 1  # one prefill for the whole static batch
    (stamp,) = stamps
    assert stamp is not None and before <= stamp <= after
    ends = [o.last_token_ms for o in outs]
    assert all(e is not None and stamp <= e <= after for e in ends)


def test_each_row_stops_at_its_own_max_new_tokens(static: TransformersRunner) -> None:
    limits = [1, 5, 12, 3, 7, 2]
    outs = static.run([_gen(i, p, n) for i, (p, n) in enumerate(zip(PROMPTS, limits, strict=True))])
    full = static.run([_gen(20 + i, p, 12) for i, p in enumerate(PROMPTS)])
    assert len(outs) == len(full) == len(limits)
    for out, whole, n in zip(outs, full, limits, strict=True):
        assert out.tokens_out == n and out.token_ids == (whole.token_ids or [])[:n]


def test_eos_stops_a_row_early(static: TransformersRunner, tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    """Pick a prompt whose greedy sequence brings a new token after the first; end on it."""
    found = [
        (prompt, tokens, k)
        for prompt, out in zip(PROMPTS, static.run([_gen(i, p, 12) for i, p in enumerate(PROMPTS)]), strict=True)
        for tokens in [out.token_ids or []]
        for k in range(1, len(tokens))
        if tokens[k] not in tokens[:k]
    ]
    assert found, "no prompt of the tiny model produces two different tokens"
    prompt, tokens, cut = found[0]
    stopping = _runner(with_stop_token(tiny_gpt2_dir, tmp_path / "eos", tokens[cut]), max_new_tokens=12)
    (out,) = stopping.run([_gen(1, prompt, 12)])
    assert out.token_ids == tokens[:cut] and out.tokens_out == cut < 12


def test_iteration_level_joins_give_the_static_answers(static: TransformersRunner, tiny_gpt2_dir: Path) -> None:
    """Batches that join a running set mid-decode get exactly what they get alone."""
    runner = _runner(tiny_gpt2_dir, max_new_tokens=12, batching="iteration")
    assert runner.iteration is not None
    limits = [12, 3, 9, 1, 12, 6]
    expected = [
        static.run([_gen(100 + i, p, n)])[0].token_ids for i, (p, n) in enumerate(zip(PROMPTS, limits, strict=True))
    ]
    got: dict[int, list[int] | None] = {}

    def submit(indices: list[int]) -> None:
        outs = runner.run([_gen(200 + i, PROMPTS[i], limits[i]) for i in indices])
        got.update({i: o.token_ids for i, o in zip(indices, outs, strict=True)})

    threads = [threading.Thread(target=submit, args=(group,)) for group in ([0, 1], [2], [3, 4], [5])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    runner.close()
    assert [got[i] for i in range(len(PROMPTS))] == expected
    assert runner.iteration.joins >= 1


def test_token_cap_bounds_the_running_set(static: TransformersRunner) -> None:
    """With room for one request's prompt + max_new_tokens, joiners wait for the row to leave."""
    reserved: list[int] = []
    assert static.device is not None

    class Watched(RunningSet):
        def step(self) -> list[Sequence]:
            reserved.append(self.reserved_tokens)
            return super().step()

    def new_running() -> RunningSet:
        return Watched(static._model, "cpu", static._pad_id, static._stop_ids)

    ids = [static._tokenize([p])[0] for p in PROMPTS[:3]]
    cap = max(len(x) for x in ids) + 4
    scheduler = IterationScheduler(new_running, static._to_output, token_cap=cap)
    results: list[list[int] | None] = [None] * 3

    def submit(i: int) -> None:
        results[i] = scheduler.run([Sequence(ids[i], 4)])[0].token_ids

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    scheduler.close()
    assert all(r is not None and len(r) == 4 for r in results)
    assert reserved and max(reserved) <= cap
    assert scheduler.joins == 3  # one at a time: two never fit together


def test_bad_generation_requests_are_refused_with_a_reason(tiny_gpt2_dir: Path) -> None:
    runner = _runner(tiny_gpt2_dir, max_new_tokens=8)
    assert runner.check(_gen(1, "kafka", 8)) is None
    over = runner.check(_gen(2, "kafka", 9))
    assert over is not None and "max_new_tokens 9 is over this model's limit 8" in over
    for empty in (_gen(3, "", 4), _gen(4, "   ", 4), Request(id="e", model="g", token_ids=[])):
        why = runner.check(empty)
        assert why is not None and "empty prompt" in why
    long = runner.check(Request(id="l", model="g", token_ids=[5] * 121))
    assert long is not None and "at most 120" in long and "context 128 less max_new_tokens 8" in long


def test_tokens_unit_refuses_a_request_that_could_never_fit(tiny_gpt2_dir: Path) -> None:
    profile = BatchProfile(cost_unit="tokens", hard_cap=40, target_size=20)
    runner = _runner(tiny_gpt2_dir, max_new_tokens=16, profile=profile)
    assert (
        runner.check(Request(id="ok", model="g", token_ids=[5] * 24, params=GenerationParams(max_new_tokens=16)))
        is None
    )
    why = runner.check(Request(id="no", model="g", token_ids=[5] * 25, params=GenerationParams(max_new_tokens=16)))
    assert why is not None and "needs 41 tokens (prompt 25 + max_new_tokens 16)" in why and "at most 40" in why


def test_nobody_joins_while_a_step_takes_longer_than_the_step_budget(static: TransformersRunner) -> None:
    """At its time-per-token budget the running set only drains: no processor sharing at overload."""
    sizes: list[int] = []

    class Watched(RunningSet):
        def step(self) -> list[Sequence]:
            sizes.append(len(self.rows))
            return super().step()

    scheduler = IterationScheduler(
        lambda: Watched(static._model, "cpu", static._pad_id, static._stop_ids), static._to_output, step_budget_ms=1e-6
    )
    ids = [static._tokenize([p])[0] for p in PROMPTS[:4]]
    results: list[int] = []

    def submit(i: int) -> None:
        results.append(len(scheduler.run([Sequence(ids[i], 6), Sequence(ids[i + 1], 3)])[0].token_ids or []))

    import time

    threads = [threading.Thread(target=submit, args=(i,)) for i in (0, 2)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while scheduler.steps < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    threads[1].start()  # arrives while the first batch is decoding
    for t in threads:
        t.join(60)
    scheduler.close()
    assert sorted(results) == [6, 6]
    assert max(sizes) <= 2 and scheduler.joins == 2  # the second batch waited for the set to empty


def test_auto_token_cap_is_the_engines_resolved_ceiling(
    tiny_gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """hard_cap = "auto" in tokens: the runner refuses by the cap the engine resolved from the device profile
    (a static batch's device memory limit), and the consumer says at start that it will."""
    import json

    from consumers.worker import build_consumer
    from pipeline.core.config import load_config

    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "g.json").write_text(json.dumps({
        "format": "batchtide-profile/1", "model": "g", "model_path": str(tiny_gpt2_dir), "runner": "transformers",
        "torch_threads": 1, "task": "generate", "unit": "tokens", "memory": {"limit_units": 40},
        "cost_points": [[20, 5.0], [40, 9.0]], "recommended": {"hard_cap": 40},
    }))  # fmt: skip
    monkeypatch.setenv("BATCHTIDE_PROFILE_DIR", str(profiles))
    config = tmp_path / "c.toml"
    config.write_text(
        f'[models.g]\nmodel_path = "{tiny_gpt2_dir}"\ntask = "generate"\ntorch_threads = 1\nisolation = "thread"\n'
        'max_new_tokens = 16\ncost_unit = "tokens"\nhard_cap = "auto"\n'
    )
    with caplog.at_level("WARNING", logger="batchtide.consumer"):
        consumer = build_consumer(load_config(config), "g")
    assert consumer.engine.ceiling == 40
    assert "hard_cap 40 tokens is under the longest request it admits" in caplog.text
    consumer.runner.load()
    assert (
        consumer.runner.check(
            Request(id="ok", model="g", token_ids=[5] * 24, params=GenerationParams(max_new_tokens=16))
        )
        is None
    )
    why = consumer.runner.check(
        Request(id="no", model="g", token_ids=[5] * 25, params=GenerationParams(max_new_tokens=16))
    )
    assert why is not None and "at most 40" in why
    consumer.runner.close()
