"""No tracked file over 1 MB: the repository holds source and small fixtures; build outputs, wheels
and data sets are made or fetched, never committed (a wheel once made up 99% of its bytes)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 1_000_000


def test_no_tracked_file_is_over_1_mb() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [ROOT / name for name in listed.decode().split("\0") if name]
    assert paths, "git ls-files listed nothing"
    sizes = {p.relative_to(ROOT).as_posix(): p.stat().st_size for p in paths if p.is_file()}
    over = sorted((size, name) for name, size in sizes.items() if size > LIMIT_BYTES)
    assert not over, f"tracked files over 1 MB: {over}"
