"""The README's "Using it" block, run as written: a README change that breaks it fails here.

The block's lines run unchanged, in one bash session (so `&` jobs and `kill %1` mean what they
mean in a terminal), in a working directory the test prepares behind the block's own file
names: `batchtide.toml` points at the session's broker (a fresh topic prefix) and a tiny real
BERT model for `minilm`, `scenarios/demo.toml` is a five-second scenario, and `var/kafka` is the
session broker's data directory, so `batchtide local up` finds it running. Between lines the
script waits where a person would (tests/readme/settle.py): until a backgrounded consumer joined,
until the produced requests are answered, until the sink stored the last events.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.tools.devtools.localkafka import LocalKafka
from tests.support.kafka import unique_prefix

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = 60
SCENARIO = f"""
name = "walkthrough"
description = "five seconds at {REQUESTS // 5} req/s"
seed = 7
[[phases]]
duration_s = 5
rate_per_s = {REQUESTS // 5}
[tokens]
prompt = {{ dist = "fixed", value = 8 }}
output = {{ dist = "fixed", value = 0 }}
[cost]
a_ms = 5.0
c_ms = 0.5
"""


def using_it_block(readme: str) -> list[str]:
    """The command lines of the first bash block under "## Using it"."""
    section = readme.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, "the Using it section has no ```bash block"
    return [line for line in match.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _command(line: str) -> str:
    """The line without its trailing comment (for classifying it, never for running it)."""
    return re.sub(r"\s+#.*$", "", line).strip()


def script(lines: list[str], python: str) -> str:
    """The block as a bash script: each line as written, its exit status reported, and the
    waits a person makes between lines."""
    settle = f"{python} -m tests.readme.settle batchtide.toml"
    out = ["set -u", 'fail() { echo "::settle-failed $1"; kill %1 %2 2>/dev/null; exit 1; }']
    for i, line in enumerate(lines):
        command = _command(line)
        out.append(f'echo "::begin {i}"')
        if command.startswith("kill %1"):
            out.append(f"{settle} stored || fail {i}")
        out.append(line)
        if command.endswith("&"):
            out.append(f'echo "::rc {i} started"')
            if " consume " in f" {command} ":
                out.append(f"{settle} members || fail {i}")
            continue
        out.append(f'echo "::rc {i} $?"')
        if " produce " in f" {command} ":
            out.append(f"{settle} answered || fail {i}")
    out.append('for job in $(jobs -p); do kill "$job"; done; wait  # what the block left running')
    return "\n".join(out) + "\n"


def _sections(output: str, lines: list[str]) -> dict[str, str]:
    """Output of each line, keyed by the line's command."""
    parts = re.split(r"^::begin (\d+)$", output, flags=re.M)
    return {_command(lines[int(parts[i])]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _run_session(text: str, cwd: Path, env: dict[str, str], timeout_s: float = 420) -> subprocess.CompletedProcess[str]:
    """One bash session in its own process group: on a timeout every process it started goes too."""
    process = subprocess.Popen(
        ["bash", "-c", text], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the block did not finish in {timeout_s} s:\n{(stdout + stderr)[-6000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def test_block_parses_as_the_commands_a_user_types() -> None:
    lines = using_it_block((ROOT / "README.md").read_text())
    assert all(line.startswith(("batchtide ", "kill ")) for line in lines), lines
    assert [c.split()[1] for c in map(_command, lines) if c.startswith("batchtide")][:3] == ["local", "topics", "db"]


@pytest.mark.model
def test_readme_using_it_block_runs_as_written(kafka_broker: LocalKafka, tiny_bert_dir: Path, tmp_path: Path) -> None:
    lines = using_it_block((ROOT / "README.md").read_text())
    work = tmp_path / "work"
    (work / "var").mkdir(parents=True)
    (work / "var" / "kafka").symlink_to(kafka_broker.data_dir)
    (work / "scenarios").mkdir()
    (work / "scenarios" / "demo.toml").write_text(SCENARIO)
    prefix = unique_prefix("readme")
    (work / "batchtide.toml").write_text(
        f'[models.minilm]\nrunner = "transformers"\nmodel_path = "{tiny_bert_dir}"\ntask = "embed"\n'
        'torch_threads = 1\nisolation = "thread"\npartitions = 2\n\n'
        f'[kafka]\nbootstrap_servers = "{kafka_broker.bootstrap}"\ntopic_prefix = "{prefix}"\nevents_partitions = 1\n\n'
        '[clickhouse]\ndata_dir = "var/clickhouse"\ninsert_interval_ms = 200\n\n'
        "[consumer]\nlag_interval_ms = 500\n"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "batchtide"
    launcher.write_text(f'#!/bin/sh\nexec {sys.executable} -m pipeline.cli "$@"\n')
    launcher.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
    }
    env.pop("BATCHTIDE_CLICKHOUSE_URL", None)
    run = _run_session(script(lines, sys.executable), work, env)
    output = run.stdout + run.stderr
    assert "::settle-failed" not in run.stdout, output[-6000:]
    codes = dict(re.findall(r"^::rc (\d+) (\S+)$", run.stdout, re.M))
    assert sorted(int(i) for i in codes) == list(range(len(lines))), output[-6000:]
    failed = {lines[int(i)]: rc for i, rc in codes.items() if rc not in ("0", "started")}
    assert not failed, f"{failed}\n{output[-6000:]}"

    out = _sections(run.stdout, lines)
    assert "already running" in out["batchtide local up"]
    status = next(text for command, text in out.items() if command.startswith("batchtide status"))
    assert re.search(r"model minilm .* state Stable  members 1  lag 0 ", status), status
    assert "learned cap" in status and "last batch" in status
    assert re.search(r"sink group \S+-sink  state Stable  members 1 ", status), status
    produced = next(text for command, text in out.items() if command.startswith("batchtide produce"))
    sent = int(re.search(r"sent (\d+) requests", produced).group(1))  # type: ignore[union-attr]
    assert sent > REQUESTS / 3
    results = next(text for command, text in out.items() if command.startswith("batchtide results")).splitlines()
    answers = [line for line in results if "  ok  " in line]
    assert len(answers) == sent, results[:5]
    assert all("embedding dim 32 norm" in line for line in answers)
    report = next(text for command, text in out.items() if command.startswith("batchtide report"))
    assert "minilm" in report and "Consumer lag" in report and "no lag samples" not in report, report[-3000:]
    page = (work / "out" / "board.html").read_text()
    for key in ("tail_latency", "consumer_lag", "consumer_lag_age"):
        assert re.search(rf'data-panel="{key}" data-state="rendered"', page), key
