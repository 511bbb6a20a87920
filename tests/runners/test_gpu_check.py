"""`make gpu-check` on a machine without CUDA: it stops at once, says why, and leaves a result file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.tools.devtools import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: `make gpu-check` runs for real")
def test_without_cuda_it_exits_2_with_the_reason_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["ok"] is False and result["steps"] == {} and "is_available() is False" in result["failed"]
