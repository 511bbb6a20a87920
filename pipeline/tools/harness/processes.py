"""Pipeline processes (`batchtide consume`, `batchtide sink`) started as a user starts them, so they can
be stopped cleanly, really killed, and measured.

Every process gets the offline model settings and its own log file, and dies
with whoever started it (`setpriv --pdeathsig`), so no run leaves strays.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from pipeline.tools.harness.errors import HarnessError

REPO_ROOT = Path(__file__).resolve().parents[3]

SINK_ENV = {"BROKER_SESSION_TIMEOUT": "10"}
"""faust reads its settings from the environment too. Its default session timeout
(60 s) makes a crashed sink's partitions wait a minute before a restarted sink
may take them; the harness deploys the sink as an operator should, with the
same 10 s the consumers' aiokafka default uses."""


def cli(*args: str) -> list[str]:
    """The argv of `batchtide ARGS` run from this checkout."""
    return [sys.executable, "-m", "pipeline.cli", *args]


def consume_argv(model: str, config: Path, consumer_id: str, *extra: str) -> list[str]:
    """`batchtide consume` of one model's group, as consumer `consumer_id`."""
    return cli("consume", "--model", model, "--config", str(config), "--consumer-id", consumer_id, *extra)


def sink_argv(config: Path) -> list[str]:
    return cli("sink", "--config", str(config))


def child_env(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This environment, offline (models come from the local cache), with this checkout importable
    first, `extra` added and the names in `drop` removed."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return {name: value for name, value in {**env, **(extra or {})}.items() if name not in drop}


class Proc:
    """One pipeline process, run by the harness so it can be stopped, killed and measured.

    `death_signal` is what the process gets if its starter dies first: KILL
    for a fault scenario (a crash, as it would be), TERM for a bench (its clean stop).
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        *,
        death_signal: str = "KILL",
        drop_env: tuple[str, ...] = (),
        cores: tuple[int, ...] = (),
    ) -> None:
        """`cores`: the CPUs it (and every process it starts) may run on; empty: any."""
        self.name = name
        self.argv = argv
        self.cores = cores
        self.extra_env = dict(env or {})
        self.drop_env = drop_env
        self.log_path = log_dir / f"{name}.log"
        self.death_signal = death_signal
        self._popen: subprocess.Popen[bytes] | None = None
        self.meant_up = False
        """Started and not deliberately stopped: if it is not alive, it crashed."""

    def start(self) -> None:
        """Start (again), appending to its log."""
        guard = shutil.which("setpriv")
        argv = self.argv
        if self.cores:
            pin = shutil.which("taskset")
            if pin is None:
                raise HarnessError(f"{self.name}: pinning to cores {self.cores} needs taskset (util-linux)")
            argv = [pin, "--cpu-list", ",".join(map(str, self.cores)), *argv]
        argv = [guard, "--pdeathsig", self.death_signal, *argv] if guard else argv
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            self._popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=child_env(self.extra_env, self.drop_env),
            )
        self.meant_up = True

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen is not None else None

    def wait(self, timeout_s: float) -> int | None:
        """The exit code once the process ends, or None if it is still running after `timeout_s`."""
        if self._popen is None:
            return None
        try:
            return self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, in-flight work is lost as in a crash."""
        self.meant_up = False
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(signal.SIGKILL)
            self._popen.wait(timeout=10)

    def request_stop(self) -> None:
        """SIGTERM without waiting: the process leaves its group cleanly in its own time."""
        self.meant_up = False
        if self._popen is not None and self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)

    def terminate(self, timeout_s: float = 20.0) -> bool:
        """SIGTERM and wait for a clean exit; SIGKILL if it does not come. True if it stopped by itself."""
        self.meant_up = False
        if self._popen is None or self._popen.poll() is not None:
            return True
        self._popen.send_signal(signal.SIGTERM)
        if self.wait(timeout_s) is None:
            self.kill()
            return False
        return True

    def _tree(self) -> list[psutil.Process]:
        """The process and its children (a consumer's device processes)."""
        if not self.alive or self.pid is None:
            return []
        try:
            parent = psutil.Process(self.pid)
            return [parent, *parent.children(recursive=True)]
        except psutil.Error:
            return []

    def rss_bytes(self, *, children: bool = False) -> int:
        """Resident memory now, of the process alone or with its children."""
        total = 0
        for each in self._tree()[: None if children else 1]:
            try:
                total += int(each.memory_info().rss)
            except psutil.Error:
                continue
        return total

    def cpu_s(self) -> float:
        """CPU seconds used so far by the process and its children."""
        total = 0.0
        for each in self._tree():
            try:
                times = each.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                continue
        return total

    def log_tail(self, lines: int = 25) -> str:
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""


class Processes:
    """The consumer and sink processes of one deployment: started by name, checked, measured and
    stopped together (also when the run fails)."""

    def __init__(self, log_dir: Path, *, death_signal: str = "KILL") -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.death_signal = death_signal
        self.consumers: dict[str, Proc] = {}
        self.sinks: list[Proc] = []

    @property
    def all(self) -> list[Proc]:
        return [*self.consumers.values(), *self.sinks]

    def consumer(
        self,
        model: str,
        config: Path,
        consumer_id: str,
        *extra: str,
        env: dict[str, str] | None = None,
        cores: tuple[int, ...] = (),
    ) -> Proc:
        """Start a consumer of the model's group as `consumer_id` (again, if it ran before), on `cores`
        when given (its device processes too)."""
        proc = self.consumers.get(consumer_id) or Proc(
            f"consumer-{consumer_id}", consume_argv(model, config, consumer_id, *extra), self.log_dir, env,
            death_signal=self.death_signal, cores=cores,
        )  # fmt: skip
        self.consumers[consumer_id] = proc
        proc.start()
        return proc

    def sink(self, config: Path, name: str = "sink") -> Proc:
        """Start a sink process (`batchtide sink`), deployed with SINK_ENV."""
        proc = Proc(
            f"{name}-{len(self.sinks)}", sink_argv(config), self.log_dir, SINK_ENV, death_signal=self.death_signal
        )
        self.sinks.append(proc)
        proc.start()
        return proc

    def crashed(self) -> Proc | None:
        """A process nobody stopped that is not running any more (a crash is not a fault we injected)."""
        return next((proc for proc in self.all if proc.meant_up and not proc.alive), None)

    def cpu_s(self) -> float:
        """CPU seconds used so far by the consumers and their device processes."""
        return sum(proc.cpu_s() for proc in self.consumers.values())

    def rss_mib(self) -> float:
        """Resident memory now of the consumers and their device processes, MiB."""
        return sum(proc.rss_bytes(children=True) for proc in self.consumers.values()) / 2**20

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to every process at once, then wait up to `timeout_s` each; SIGKILL what is left."""
        running = [proc for proc in self.all if proc.alive]
        for proc in running:
            proc.request_stop()
        for proc in running:
            if proc.wait(timeout_s) is None:
                proc.kill()
