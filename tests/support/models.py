"""Fixtures: tiny real transformers models built offline in a temp dir.

A byte-level BPE tokenizer is trained with `tokenizers` on a few sentences and
saved as a `PreTrainedTokenizerFast` next to a randomly initialised 2-layer
model (BERT for embeddings, GPT-2 for generation). Both load through
AutoTokenizer/AutoModel from the directory with HF_HUB_OFFLINE=1, like any
model a user points `model_path` at. Building both takes well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SENTENCES = [
    "batchtide batches requests that arrive on kafka topics",
    "the quick brown fox jumps over the lazy dog",
    "tail latency grows when a fixed window waits too long",
    "a hard cap keeps one burst from filling memory",
    "results go back to kafka and events go to clickhouse",
    "grafana shows p99 and the batch size distribution",
    "0123456789 !?.,;:-_'\"()[]{}",
]
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<|endoftext|>"]
HIDDEN = 32
LAYERS = 2
MAX_POSITIONS = 128


def _tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        model_max_length=MAX_POSITIONS,
    )


def _save(directory: Path, model_class: type, config_class: type, **shape: object) -> Path:
    """A seeded random model of `config_class(**shape)` with the tiny tokenizer, saved to `directory`."""
    import torch

    tokenizer = _tokenizer()
    torch.manual_seed(0)
    config = config_class(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **shape)
    model_class(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_tiny_bert(directory: Path) -> Path:
    """A 2-layer BERT encoder (hidden 32) with the tiny tokenizer, saved to `directory`."""
    from transformers import BertConfig, BertModel

    return _save(
        directory, BertModel, BertConfig, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=MAX_POSITIONS,
    )  # fmt: skip


def build_tiny_gpt2(directory: Path, *, layers: int = LAYERS, hidden: int = HIDDEN) -> Path:
    """A 2-layer GPT-2 causal LM (hidden 32) with the tiny tokenizer, saved to `directory` (`layers`
    and `hidden` make a heavier one: the same tokenizer, a slower decode step)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    eos = _tokenizer().eos_token_id
    return _save(
        directory, GPT2LMHeadModel, GPT2Config, n_embd=hidden, n_layer=layers, n_head=2, n_positions=MAX_POSITIONS,
        bos_token_id=eos, eos_token_id=eos,
    )  # fmt: skip


def build_tiny_llama(directory: Path) -> Path:
    """A 2-layer Llama causal LM (hidden 32) with grouped-query attention: 4 query heads share
    2 key/value heads, as in SmolLM2 (the decode-step attention path for grouped heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = _tokenizer().eos_token_id
    return _save(
        directory, LlamaForCausalLM, LlamaConfig, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=MAX_POSITIONS, bos_token_id=eos,
        eos_token_id=eos,
    )  # fmt: skip


def with_stop_token(source: Path, target: Path, eos_id: int) -> Path:
    """A copy of a saved causal LM whose generation config ends on `eos_id`: a greedy
    sequence known from the original then has a known early stop."""
    import shutil

    shutil.copytree(source, target, dirs_exist_ok=True)
    config = json.loads((target / "generation_config.json").read_text())
    config["eos_token_id"] = eos_id
    (target / "generation_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
