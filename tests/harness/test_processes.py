"""The harness's process handle: what it starts is really stopped, really killed and measured, and
its config file reads back as written. Real processes; nothing here needs a broker."""

from __future__ import annotations

import os
import sys
import time
import tomllib
from pathlib import Path

import psutil
import pytest

from pipeline.core.config import KafkaSettings
from pipeline.tools.bench.pipeline.co_tenant import CoTenant
from pipeline.tools.harness.config_file import kafka_table, toml_text
from pipeline.tools.harness.processes import Proc, Processes, child_env

STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('re' + 'ady', flush=True)\ntime.sleep(60)\n"
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; x = bytearray(64 * 2**20); time.sleep(60)'])\n"
    "sum(range(3_000_000))\nprint('re' + 'ady', flush=True)\ntime.sleep(60)\n"
)


def _until_logged(proc: Proc, text: str, timeout_s: float = 30.0) -> None:
    """Until the process printed `text` (spelled apart in its argv, so the log's start line does not match)."""
    deadline = time.monotonic() + timeout_s
    while text not in proc.log_text():
        assert proc.alive and time.monotonic() < deadline, proc.log_text()
        time.sleep(0.05)


def test_sigterm_stops_a_process_cleanly_and_one_that_ignores_it_is_killed(tmp_path: Path) -> None:
    polite = Proc("polite", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path)
    stubborn = Proc("stubborn", [sys.executable, "-c", STUBBORN], tmp_path)
    polite.start()
    stubborn.start()
    _until_logged(stubborn, "ready")
    assert polite.terminate(timeout_s=10) is True
    assert polite.returncode == -15 and not polite.meant_up
    assert stubborn.terminate(timeout_s=0.5) is False, "SIGTERM ignored: it had to be killed"
    assert stubborn.returncode == -9 and not stubborn.alive


def test_a_crash_is_told_apart_from_a_stop_and_memory_counts_the_children(tmp_path: Path) -> None:
    group = Processes(tmp_path / "logs")
    parent = Proc("parent", [sys.executable, "-c", PARENT], group.log_dir)
    group.consumers["parent"] = parent
    parent.start()
    _until_logged(parent, "ready")
    time.sleep(0.5)  # the child has touched its 64 MiB
    assert parent.rss_bytes(children=True) - parent.rss_bytes() > 60 * 2**20
    assert group.rss_mib() * 2**20 == pytest.approx(parent.rss_bytes(children=True), rel=0.05)
    assert group.cpu_s() > 0
    assert group.crashed() is None
    crasher = Proc("crasher", [sys.executable, "-c", "raise SystemExit(3)"], group.log_dir)
    group.consumers["crasher"] = crasher
    crasher.start()
    assert crasher.wait(30) == 3
    assert group.crashed() is crasher
    group.stop(timeout_s=10)
    assert not parent.alive and not parent.meant_up, "stopped on purpose is not a crash"
    assert group.crashed() is crasher, "and stopping the rest does not hide the one that crashed"


def test_child_environment_is_offline_and_drops_what_it_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHTIDE_SECRET", "x")
    env = child_env({"EXTRA": "1"}, drop=("BATCHTIDE_SECRET",))
    assert env["HF_HUB_OFFLINE"] == "1" and env["EXTRA"] == "1" and "BATCHTIDE_SECRET" not in env
    assert env["PYTHONPATH"].split(":")[0] == str(Path(__file__).resolve().parents[2])


def test_config_file_reads_back_as_written() -> None:
    tables = {
        "kafka": kafka_table(KafkaSettings(bootstrap_servers="h:1", topic_prefix='odd"prefix'), transactional=True),
        "models.m": {"runner": "cost-model", "cost_a_ms": 2.5, "hard_cap": 8, "poison_marker": None},
    }
    assert tomllib.loads(toml_text(tables)) == {
        "kafka": {"bootstrap_servers": "h:1", "topic_prefix": 'odd"prefix', "transactional": True},
        "models": {"m": {"runner": "cost-model", "cost_a_ms": 2.5, "hard_cap": 8}},
    }
    with pytest.raises(TypeError, match="cannot write"):
        toml_text({"t": {"k": [1, 2]}})


PINNED = "import os, subprocess, sys\nprint('cores', sorted(os.sched_getaffinity(0)), flush=True)\n" + (
    "subprocess.run([sys.executable, '-c', 'import os; print(\"child\", sorted(os.sched_getaffinity(0)))'])\n"
)


def test_a_pinned_process_and_the_processes_it_starts_run_on_its_cores_only(tmp_path: Path) -> None:
    """How a bench gives each consumer (and its device processes) a core of its own."""
    core = max(os.sched_getaffinity(0))
    pinned = Proc("pinned", [sys.executable, "-c", PINNED], tmp_path, cores=(core,))
    pinned.start()
    assert pinned.wait(30) == 0, pinned.log_text()
    assert f"cores [{core}]" in pinned.log_text() and f"child [{core}]" in pinned.log_text()


def test_a_co_tenant_spins_on_its_core_until_stopped_and_starts_again(tmp_path: Path) -> None:
    """The bench's slow member: a busy process on the consumer's core takes CPU from it."""
    core = min(os.sched_getaffinity(0))
    tenant = CoTenant(core, tmp_path)
    tenant.start()
    try:
        proc = psutil.Process(tenant.pid)
        deadline = time.monotonic() + 10
        while proc.cpu_affinity() != [core] and time.monotonic() < deadline:  # taskset sets it, then execs python
            time.sleep(0.05)
        assert proc.cpu_affinity() == [core]
        time.sleep(0.5)
        assert proc.cpu_times().user > 0.1, "it spins"
    finally:
        tenant.stop()
    assert not tenant.running
    tenant.start()
    assert tenant.running
    tenant.stop()
