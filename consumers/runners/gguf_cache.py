"""Convert a GGUF model once into a plain HF directory, and reuse it.

transformers dequantizes GGUF weights and rebuilds the tokenizer from the
GGUF vocabulary on every load, parsing the file several times (about a
minute for SmolLM2-135M on a busy 2-core CPU). The converted model is
saved as safetensors under `BATCHTIDE_MODEL_CACHE` (default
`~/.cache/batchtide/models`), keyed by the GGUF file's path, size and mtime,
so later loads take seconds. This is local derived data, never a download.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from .model_source import ModelSource

COMPLETE_MARK = ".batchtide-converted"


def cache_root() -> Path:
    return Path(os.environ.get("BATCHTIDE_MODEL_CACHE", "~/.cache/batchtide/models")).expanduser()


def converted_path(source: ModelSource) -> Path:
    """Where the conversion of `source` lives (whether or not it exists yet)."""
    if source.gguf_file is None:
        raise ValueError(f"{source.describe()} is not a GGUF source")
    gguf = (source.directory / source.gguf_file).resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{key}"


def _plain_copy(model: Any, task_loader: Any) -> Any:
    """The same weights in a model transformers will save: a GGUF-loaded model
    stays flagged as quantized (and unsaveable) although its weights are
    already dequantized."""
    import torch

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = task_loader.from_config(config)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    return plain.eval()


def convert_once(source: ModelSource, task_loader: Any) -> ModelSource:
    """A HF-directory source for a GGUF source, converting it on first use.

    `task_loader` is the Auto class to load the weights with (e.g.
    AutoModelForCausalLM). Conversion writes to a temp dir renamed into
    place, so concurrent consumers never see half a model.
    """
    if source.gguf_file is None:
        return source
    target = converted_path(source)
    if (target / COMPLETE_MARK).is_file():
        return ModelSource(target)
    from transformers import AutoConfig, AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file}
    config = AutoConfig.from_pretrained(source.directory, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, config=config, **kwargs)
    loaded = task_loader.from_pretrained(source.directory, config=config, **kwargs)
    model = _plain_copy(loaded, task_loader)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    (scratch / COMPLETE_MARK).write_text(f"converted from {source.describe()}\n")
    try:
        scratch.rename(target)
    except OSError:  # another consumer finished first
        shutil.rmtree(scratch, ignore_errors=True)
    return ModelSource(target)
