"""`make setup`'s launcher: `batchtide` in BIN_DIR runs the virtualenv's batchtide from any shell,
is rewritten only when it changes, never replaces a foreign file, and `make uninstall` removes it.

The Makefile runs for real, against a stand-in virtualenv directory (its `.ready` marker present,
so no install happens) whose `bin/batchtide` reports how it was called."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(target: str, venv: Path, bin_dir: Path, path: str = "/usr/bin:/bin") -> subprocess.CompletedProcess[str]:
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": path}
    return subprocess.run(
        ["make", "-s", "-C", str(ROOT), target, f"VENV={venv}", f"BIN_DIR={bin_dir}"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    root = tmp_path / "venv"
    (root / "bin").mkdir(parents=True)
    (root / ".ready").touch()
    fake = root / "bin" / "batchtide"
    fake.write_text('#!/bin/sh\necho "venv batchtide: $*"\n')
    fake.chmod(0o755)
    return root


def test_launcher_runs_the_venv_cli_from_a_bare_shell_and_is_idempotent(venv: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    first = _make("install-cli", venv, bin_dir)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"installed {bin_dir}/batchtide" in first.stdout
    assert "is not on PATH" in first.stdout, "a PATH without BIN_DIR gets the hint"
    launcher = bin_dir / "batchtide"
    stamp = launcher.stat().st_mtime_ns
    ran = subprocess.run(["sh", "-c", "batchtide local up --port 1"], env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
                         capture_output=True, text=True)  # fmt: skip
    assert ran.stdout.strip() == "venv batchtide: local up --port 1"

    again = _make("install-cli", venv, bin_dir, path=f"{bin_dir}:/usr/bin:/bin")
    assert again.returncode == 0 and again.stdout == "", again.stdout
    assert launcher.stat().st_mtime_ns == stamp, "an unchanged launcher is not rewritten"

    removed = _make("uninstall", venv, bin_dir)
    assert removed.returncode == 0 and not launcher.exists()


def test_a_batchtide_it_did_not_write_is_left_alone(venv: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    foreign = bin_dir / "batchtide"
    foreign.write_text("#!/bin/sh\necho pip-installed\n")
    result = _make("install-cli", venv, bin_dir)
    assert result.returncode == 0 and "left alone" in result.stdout
    assert foreign.read_text() == "#!/bin/sh\necho pip-installed\n"
    assert "no launcher of ours" in _make("uninstall", venv, bin_dir).stdout
    assert foreign.exists()
