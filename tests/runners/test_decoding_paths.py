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
from pipeline.config import ModelConfig

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


def test_grouped_query_models_decode_with_their_own_attention(llama: TransformersRunner, tiny_gpt2_dir: Path) -> None:
    from consumers.runners.gqa_decode import NAME

    assert llama._model.config._attn_implementation == NAME
    assert _runner(tiny_gpt2_dir, max_new_tokens=4)._model.config._attn_implementation != NAME


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


def test_rows_leave_lazily_and_joiners_get_the_same_tokens(llama: TransformersRunner, tiny_llama_dir: Path) -> None:
    ids = [llama._tokenize([p])[0] for p in PROMPTS]
    running = RunningSet(llama._model, "cpu", llama._pad_id, frozenset())
    seqs = [Sequence(ids[i % 4], 20) for i in range(8)] + [Sequence(ids[1], 2), Sequence(ids[3], 25)]
    running.join(seqs[:9])
    running.step()
    assert len(running) == 8 and len(running.rows) == 9  # one row of nine done: kept until a share are done
    assert isinstance(running._cache.layers[0], SlackLayer)
    running.join(seqs[9:])
    assert len(running.rows) == 9 and all(not s.finished for s in running.rows)  # a join compacts
    while len(running):
        running.step()
    assert [s.generated for s in seqs] == [_reference(tiny_llama_dir, s.prompt, s.limit) for s in seqs]


def test_a_deadline_stops_a_running_row_with_its_text_so_far(llama: TransformersRunner) -> None:
    class Slow(RunningSet):
        def step(self) -> list[Sequence]:
            time.sleep(0.02)
            return super().step()

    ids = [llama._tokenize([p])[0] for p in PROMPTS[:2]]
    scheduler = IterationScheduler(lambda: Slow(llama._model, "cpu", llama._pad_id, frozenset()), llama._to_output)
    soon = time.time() * 1000.0 + 250.0
    outs = scheduler.run([Sequence(ids[0], 40, deadline_ms=soon), Sequence(ids[1], 3)])
    scheduler.close()
    assert outs[0].expired and 0 < outs[0].tokens_out < 40 and outs[0].last_token_ms is not None
    assert outs[0].last_token_ms >= soon
    assert not outs[1].expired and outs[1].tokens_out == 3


def test_a_joiner_past_its_deadline_is_never_prefilled(llama: TransformersRunner) -> None:
    ids = llama._tokenize([PROMPTS[0]])[0]
    scheduler = IterationScheduler(lambda: RunningSet(llama._model, "cpu", llama._pad_id, frozenset()), llama._to_output)
    gone = time.time() * 1000.0 - 1.0
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.extend(scheduler.run([Sequence(ids, 8, deadline_ms=gone)])))
    worker.start()
    worker.join(30)
    scheduler.close()
    (out,) = results
    assert out.expired and out.tokens_out == 0  # type: ignore[attr-defined]
    assert scheduler.joins == 0 and scheduler.steps == 0


def test_static_batches_stop_expired_rows_too(llama: TransformersRunner) -> None:
    class Slow(RunningSet):
        def step(self) -> list[Sequence]:
            time.sleep(0.02)
            return super().step()

    ids = [llama._tokenize([p])[0] for p in PROMPTS[:2]]
    soon = time.time() * 1000.0 + 200.0
    seqs = [Sequence(ids[0], 40, deadline_ms=soon), Sequence(ids[1], 40)]
    started = time.monotonic()
    decode_all(Slow(llama._model, "cpu", llama._pad_id, frozenset()), seqs)
    assert seqs[0].expired and len(seqs[0].generated) < 40
    assert not seqs[1].expired and len(seqs[1].generated) == 40
    assert time.monotonic() - started >= 0.02 * 39
