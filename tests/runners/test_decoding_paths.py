"""The running set's own fast paths give transformers' answers: grouped-query decode attention,
KV buffers that grow in place, lazy compaction; and deadlines stop generation, not only dispatch."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest

from consumers.runners import make_runner
from consumers.runners.decoding import RunningSet, Sequence, decode_all
from consumers.runners.iteration import IterationScheduler
from consumers.runners.kv_slack import SLACK, SlackLayer
from consumers.runners.transformers_runner import TransformersRunner
from pipeline.core.config import ModelConfig

PROMPTS = ["the quick brown fox", "kafka", "results go back to kafka and events go to", "grafana shows p99"]


def _runner(directory: Path, **fields: object) -> TransformersRunner:
    runner = make_runner(ModelConfig(name="g", model_path=str(directory), torch_threads=1, **fields))  # type: ignore[arg-type]
    assert isinstance(runner, TransformersRunner)
    runner.load()
    return runner


def _reference(directory: Path, prompt: list[int], new: int) -> list[int]:
    """transformers' own greedy generate, one prompt alone (no padding), default attention."""
    return list(_generated(str(directory), tuple(prompt), new))


@functools.cache
def _generated(directory: str, prompt: tuple[int, ...], new: int) -> tuple[int, ...]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return tuple(out[0, len(prompt) :].tolist())


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> TransformersRunner:
    return _runner(tiny_llama_dir, max_new_tokens=40)


@pytest.mark.model
def test_generation_models_decode_with_their_own_attention(llama: TransformersRunner, tiny_gpt2_dir: Path) -> None:
    from consumers.runners.fused_step import NAME

    assert llama._model.config._attn_implementation == NAME
    assert _runner(tiny_gpt2_dir, max_new_tokens=4)._model.config._attn_implementation == NAME


@pytest.mark.model
def test_rows_attend_their_own_columns_after_a_long_row_joined(llama: TransformersRunner, tiny_llama_dir: Path) -> None:
    """Short rows beside one long row: a step splits them (all rows over the short ones' columns,
    the long row alone over the whole width), and every row's tokens are what it gets alone."""
    import torch

    from consumers.runners.gqa_decode import column_plan

    ids = [llama._tokenize([p])[0] for p in PROMPTS]
    long = llama._tokenize([" ".join(PROMPTS * 3)])[0]
    mask = torch.zeros((5, len(long) + 1), dtype=torch.long)
    mask[0] = 1
    for row in range(1, 5):
        mask[row, -len(ids[row - 1]) - 1 :] = 1
    plan = column_plan(mask)
    assert plan is not None and plan.wide.tolist() == [0] and plan.cut == len(long) + 1 - max(len(x) + 1 for x in ids)
    assert column_plan(torch.ones((5, 9), dtype=torch.long)) is None  # no padding: one pass
    running = RunningSet(llama._model, "cpu", llama._pad_id, frozenset())
    seqs = [Sequence(long, 12)] + [Sequence(x, 12) for x in ids]
    decode_all(running, seqs)
    assert [s.generated for s in seqs] == [_reference(tiny_llama_dir, s.prompt, s.limit) for s in seqs]


def test_a_full_buffer_grows_by_a_quarter_of_its_width() -> None:
    import torch

    keys = torch.ones((2, 1, 400, 2))
    layer = SlackLayer.stacked([(keys, keys.clone())], 400)
    for _ in range(SLACK + 1):
        layer.update(torch.ones((2, 1, 1, 2)), torch.ones((2, 1, 1, 2)))
    assert layer._k.shape[-2] == 400 + SLACK + (400 + SLACK) // 4
    assert torch.equal(layer.keys, torch.ones((2, 1, 400 + SLACK + 1, 2)))


@pytest.mark.model
def test_padded_running_set_gives_transformers_greedy_tokens(llama: TransformersRunner, tiny_llama_dir: Path) -> None:
    """Prompts of different lengths (left padding, so a mask) decoding past SLACK columns
    (the buffers regrow) give what transformers generates for each prompt alone."""
    new = SLACK + 8
    ids = [llama._tokenize([p])[0] for p in PROMPTS]
    assert len({len(x) for x in ids}) > 1
    running = RunningSet(llama._model, "cpu", llama._pad_id, frozenset())
    seqs = [Sequence(x, new) for x in ids]
    decode_all(running, seqs)
    assert [s.generated for s in seqs] == [_reference(tiny_llama_dir, x, new) for x in ids]


@pytest.mark.model
def test_rows_leave_lazily_and_joiners_get_the_same_tokens(llama: TransformersRunner, tiny_llama_dir: Path) -> None:
    ids = [llama._tokenize([p])[0] for p in PROMPTS]
    running = RunningSet(llama._model, "cpu", llama._pad_id, frozenset())
    seqs = [Sequence(ids[i % 4], 20) for i in range(8)] + [Sequence(ids[1], 2), Sequence(ids[3], 25)]
    running.join(seqs[:9])
    running.step()
    assert len(running) == 8 and len(running.rows) == 9  # one row of nine done: kept until a share are done
    assert isinstance(running._cache.layers[0], SlackLayer)
    running.join(seqs[9:])
    assert len(running.rows) == 9 and all(not s.finished for s in running.rows)  # the joiner took the done row's place
    while len(running):
        running.step()
    assert [s.generated for s in seqs] == [_reference(tiny_llama_dir, s.prompt, s.limit) for s in seqs]


@pytest.mark.model
def test_joiners_fill_spare_rows_in_place(llama: TransformersRunner, tiny_llama_dir: Path) -> None:
    """Later joiners, the longest prompt included, land in the buffers' spare rows without a copy
    of the running cache, and decode as if alone."""
    ids = [llama._tokenize([p])[0] for p in PROMPTS]
    long = llama._tokenize([" ".join(PROMPTS)])[0]
    running = RunningSet(llama._model, "cpu", llama._pad_id, frozenset())
    first = Sequence(ids[1], len(long) + 8)
    running.join([first])
    for _ in range(len(long)):
        running.step()
    buffer = running._cache.layers[0]._k
    joiners = [Sequence(long, 6), Sequence(ids[2], 5), Sequence(ids[3], 4)]
    running.join(joiners)
    assert running._cache.layers[0]._k is buffer and len(running.rows) == 4
    while len(running):
        running.step()
    everyone = [first, *joiners]
    assert [s.generated for s in everyone] == [_reference(tiny_llama_dir, s.prompt, s.limit) for s in everyone]


def test_a_trimmed_view_widens_back_over_zeroed_columns() -> None:
    import torch

    keys = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).reshape(2, 1, 5, 2) + 1.0
    layer = SlackLayer.stacked([(keys, keys.clone())], 5)
    assert torch.equal(layer.keys, keys) and layer.free_rows >= 8
    layer.trim(3)
    assert torch.equal(layer.keys, keys[:, :, 3:])
    assert layer.can_widen(5) and not layer.can_widen(6)
    layer._k[:, :, :3] = float("nan")  # hidden columns may hold anything ...
    layer.widen(5)
    assert torch.equal(layer.keys[:, :, 3:], keys[:, :, 3:])  # what stayed in view is untouched
    assert not torch.isnan(layer.keys).any() and torch.count_nonzero(layer.keys[:, :, :3]) == 0  # ... shown zeroed


@pytest.mark.model
def test_a_joiner_that_cannot_make_its_deadline_is_refused(llama: TransformersRunner) -> None:
    """Eight 40-token answers teach the loop how long answers run; then, at the current time per
    step, a 40-token answer needs ~0.8 s: with 0.3 s left it would only slow the running rows and
    expire, so it is refused at once; a 5-token one with 2 s left joins."""

    class Slow(RunningSet):
        def step(self) -> list[Sequence]:
            time.sleep(0.02)
            return super().step()

    ids = [llama._tokenize([p])[0] for p in PROMPTS]
    scheduler = IterationScheduler(lambda: Slow(llama._model, "cpu", llama._pad_id, frozenset()), llama._to_output)
    results: dict[str, object] = {}

    def submit(name: str, seq: Sequence) -> None:
        results[name] = scheduler.run([seq])[0]

    taught = scheduler.run([Sequence(ids[k % len(ids)], 40) for k in range(8)])
    assert [o.tokens_out for o in taught] == [40] * 8
    taught_steps = scheduler.steps
    runner = threading.Thread(target=submit, args=("long", Sequence(ids[0], 40)))
    runner.start()
    deadline = time.monotonic() + 30
    while scheduler.steps < taught_steps + 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    now = time.time() * 1000.0
    late = threading.Thread(target=submit, args=("hopeless", Sequence(ids[1], 40, deadline_ms=now + 300.0)))
    fine = threading.Thread(target=submit, args=("feasible", Sequence(ids[2], 5, deadline_ms=now + 2000.0)))
    for t in (late, fine):
        t.start()
    for t in (runner, late, fine):
        t.join(30)
    joins = scheduler.joins
    scheduler.close()
    hopeless, feasible = results["hopeless"], results["feasible"]
    assert hopeless.expired and hopeless.tokens_out == 0  # type: ignore[attr-defined]
    assert hopeless.refused == "cannot_meet_deadline"  # type: ignore[attr-defined]
    assert not feasible.expired and feasible.tokens_out == 5  # type: ignore[attr-defined]
    assert joins == 3  # the eight, the long one, then the feasible one: the hopeless one was never prefilled


@pytest.mark.model
def test_a_joiner_whose_first_token_cannot_come_in_time_is_given_up(llama: TransformersRunner) -> None:
    """Once a prefill measured the price of a prompt token, a joiner whose first token was due a
    moment ago cannot make it whatever the order: it leaves unprefilled, `cannot_meet_slo`; one due
    in a minute is served. The consumer sets the due time from the record time and the model's
    time-to-first-token objective (consumers/device.with_deadline)."""
    from types import SimpleNamespace

    from consumers.device import with_deadline
    from pipeline.core.engine.decisions import PendingRequest
    from schemas.messages import Request

    ids = [llama._tokenize([p])[0] for p in PROMPTS]
    scheduler = IterationScheduler(
        lambda: RunningSet(llama._model, "cpu", llama._pad_id, frozenset()), llama._to_output
    )
    assert scheduler.run([Sequence(ids[0], 2)])[0].tokens_out == 2  # a one-piece prefill: the price is known
    now = time.time() * 1000.0
    late, fine = scheduler.run(
        [Sequence(ids[1], 4, first_token_by_ms=now - 1.0), Sequence(ids[2], 4, first_token_by_ms=now + 60_000.0)]
    )
    joins = scheduler.joins
    scheduler.close()
    assert late.expired and late.tokens_out == 0 and late.refused == "cannot_meet_slo"
    assert not fine.expired and fine.tokens_out == 4 and joins == 2

    held = SimpleNamespace(request=Request(id="r", model="g", text="hi"))
    pending = PendingRequest("r", 1000.0, 5, 1, 9000.0, held)
    seen = with_deadline(pending, ttft_ms=1500.0)
    assert (seen.deadline_ms, seen.first_token_deadline_ms) == (9000, 2500)
    own = SimpleNamespace(request=Request(id="s", model="g", text="hi", first_token_deadline_ms=1800))
    assert with_deadline(PendingRequest("s", 1000.0, 5, 1, None, own), ttft_ms=1500.0).first_token_deadline_ms == 1800
    assert with_deadline(pending).first_token_deadline_ms is None
