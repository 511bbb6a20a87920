"""`make setup`'s launcher: `batchtide` in BIN_DIR runs the virtualenv's batchtide from any shell,
is rewritten only when it changes, never replaces a foreign file, and `make uninstall` removes it.
When BIN_DIR is not on PATH, one marked line in the shell profiles puts it there for every new
login or interactive shell (NO_MODIFY_PATH=1 opts out), and `make uninstall` takes it out again.

The Makefile runs for real, with HOME a temporary directory, against a stand-in virtualenv
directory (its `.ready` marker present, so no install happens) whose `bin/batchtide` reports how
it was called."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(target: str, venv: Path, bin_dir: Path | None, path: str = "/usr/bin:/bin",
          **env: str) -> subprocess.CompletedProcess[str]:  # fmt: skip
    home = venv.parent / "home"
    home.mkdir(exist_ok=True)
    where = [f"BIN_DIR={bin_dir}"] if bin_dir is not None else []
    return subprocess.run(
        ["make", "-s", "-C", str(ROOT), target, f"VENV={venv}", *where],
        env={"HOME": str(home), "PATH": path, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _new_shell(home: Path, command: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`command` in a new shell of a fresh machine: only the system PATH, then the shell's own profile."""
    return subprocess.run(["bash", *flags, "-c", command], env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)  # fmt: skip


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
    assert "added" in first.stdout and "to PATH in" in first.stdout, "a PATH without BIN_DIR: the profile says so"
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


def test_a_new_login_shell_finds_batchtide_and_uninstall_takes_the_profile_line_out(venv: Path) -> None:
    home = venv.parent / "home"
    home.mkdir()
    (home / ".profile").write_text("umask 022\nexport KEPT=1")  # no final newline: ours must not join it
    (home / ".bashrc").write_text("# the user's own\n")
    assert _new_shell(home, "command -v batchtide", "-l").returncode != 0, "a fresh machine has no batchtide"

    first = _make("install-cli", venv, None)
    assert first.returncode == 0, first.stdout + first.stderr
    bin_dir = home / ".local" / "bin"
    for profile in (".profile", ".bashrc"):
        assert f"added {bin_dir} to PATH in {home / profile}" in first.stdout
    again = _make("install-cli", venv, None)
    assert "added" not in again.stdout, "a second setup adds nothing"
    for profile in (".profile", ".bashrc"):
        lines = (home / profile).read_text().splitlines()
        assert sum("make setup of batchtide" in line for line in lines) == 1, lines
    assert (home / ".profile").read_text().splitlines()[:2] == ["umask 022", "export KEPT=1"]
    assert not (home / ".zshrc").exists(), "profiles of shells the user does not have are not created"

    for flags in (("-l",), ("-i",)):
        ran = _new_shell(home, "batchtide status; echo $KEPT", *flags)
        assert "venv batchtide: status" in ran.stdout, (flags, ran.stdout, ran.stderr)
    twice = _new_shell(home, ". ~/.profile; . ~/.profile; echo $PATH", "-l").stdout.strip()
    assert twice.split(":").count(str(bin_dir)) == 1, "sourcing the profile again does not grow PATH"

    removed = _make("uninstall", venv, None)
    assert removed.returncode == 0 and f"removed the batchtide PATH line from {home / '.profile'}" in removed.stdout
    assert "batchtide" not in (home / ".profile").read_text() + (home / ".bashrc").read_text()
    assert (home / ".bashrc").read_text() == "# the user's own\n"
    assert _new_shell(home, "command -v batchtide", "-l").returncode != 0


def test_no_modify_path_and_a_path_that_has_bin_dir_leave_the_profiles_alone(venv: Path, tmp_path: Path) -> None:
    home = venv.parent / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"
    opted_out = _make("install-cli", venv, bin_dir, NO_MODIFY_PATH="1")
    assert opted_out.returncode == 0 and "NO_MODIFY_PATH" in opted_out.stdout
    assert f'export PATH="{bin_dir}:$PATH"' in opted_out.stdout, "the line to add is printed instead"
    on_path = _make("install-cli", venv, bin_dir, path=f"{bin_dir}:/usr/bin:/bin")
    assert on_path.returncode == 0 and "PATH" not in on_path.stdout
    assert not (home / ".profile").exists() and not (home / ".bashrc").exists()
