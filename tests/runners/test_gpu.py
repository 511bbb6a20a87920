"""The same runners on CUDA: half precision, device memory from torch.cuda, the profile's memory kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from consumers.runners import make_runner
from consumers.runners.transformers_runner import TransformersRunner
from pipeline.cli import app
from pipeline.core.config import ModelConfig
from schemas.messages import GenerationParams, Request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.model,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device on this machine (torch.cuda.is_available() is False)"
    ),
]


def test_generation_runs_in_half_precision_and_reports_cuda_memory(tiny_gpt2_dir: Path) -> None:
    runner = make_runner(ModelConfig(name="g", model_path=str(tiny_gpt2_dir), device="cuda", max_new_tokens=8))
    assert isinstance(runner, TransformersRunner)
    runner.load()
    assert runner._model.dtype in (torch.bfloat16, torch.float16)
    reqs = [
        Request(id=f"r{i}", model="g", text=t, params=GenerationParams(max_new_tokens=8))
        for i, t in enumerate(["kafka", "the quick brown fox"])
    ]
    first, second = runner.run(reqs), runner.run(reqs)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert all(1 <= o.tokens_out <= 8 for o in first)
    used, kind = runner.device_memory()
    assert kind == "cuda_max_allocated" and used > 0


def test_profile_measures_cuda_memory(tiny_bert_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[models.tiny]\nmodel_path = "{tiny_bert_dir}"\ndevice = "cuda"\n')
    out = tmp_path / "p.json"
    result = CliRunner().invoke(
        app,
        ["profile", "--config", str(config), "--model", "tiny", "--max-size", "8", "--seconds", "0", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["device"].startswith("cuda") and data["memory"]["kind"] == "cuda_max_allocated"
    assert data["points"][-1]["peak_bytes"] > 0
