"""`pip install .` gives the same `batchtide`: the wheel carries the entry point, every dependency
of pyproject.toml and every data file the code reads at run time (SQL migrations, JSON schemas,
dashboards and their provisioning, the broker's pom.xml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = (
    "var",
    "out",
    ".git",
    "build",
    ".pytest_cache",
    ".hypothesis",
    ".mypy_cache",
    ".ruff_cache",
    "tests",
    "peers",
    "docs",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    source = tmp_path_factory.mktemp("source") / "batchtide"
    shutil.copytree(ROOT, source, ignore=lambda d, names: [n for n in names if n in SKIP or n.endswith(".egg-info")
                                                           or n == "__pycache__"])  # fmt: skip
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source), "-w", str(out)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (built,) = out.glob("batchtide-*.whl")
    return zipfile.ZipFile(built)


def test_wheel_has_every_package_data_file(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    expected = {
        path.relative_to(ROOT).as_posix()
        for package, patterns in package_data.items()
        for pattern in patterns
        for path in (ROOT / package).glob(pattern)
        if path.is_file()
    }
    assert "schemas/clickhouse/0006_consumer_lag.sql" in expected
    assert "dashboards/provisioning/alerting/batchtide.yaml" in expected
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    read_at_run_time = {
        "schemas/lag_event.schema.json",
        "dashboards/batchtide-consumer-lag.json",
        "pipeline/tools/devtools/broker/pom.xml",
    }
    assert read_at_run_time <= names


def test_wheel_declares_the_command_and_the_same_dependencies(wheel: zipfile.ZipFile) -> None:
    info = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    points = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    assert "batchtide = pipeline.cli:app" in wheel.read(points).decode()
    metadata = Parser().parsestr(wheel.read(info).decode())
    required = {r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r}
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {d.replace(" ", "") for d in declared} == {r.replace(" ", "") for r in required}
