"""Run a model's batches in child processes, so the fetch loop and the model never share a GIL.

In one process every torch op releases and retakes the interpreter lock, so
a forward pass hands it to the event loop and back hundreds of times; on a
two-core host each hand-off can stall either side. Measured with MiniLM on
one torch thread at 120 req/s (`batchtide bench pipeline --runner minilm
--isolation thread|process`): see docs/runners.md.

The parent keeps a weightless front runner (tokenizer and limits only) for
`check()`/`measure()` and ships token ids, so a text is tokenized once. There
is one child per in-flight slot. A child that dies (segfault, OOM kill) fails
only the batch it held: `run()` raises, poison isolation bisects the batch,
and the next call starts a fresh child, so a crashing input is dead-lettered
instead of taking the consumer down.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from consumers.heap import freeze_heap
from pipeline.core.config import ModelConfig
from schemas.messages import Request

from .base import MemoryKind, Output, Runner, describe_error
from .in_process import make_runner
from .iteration import TIMED_KEPT

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]


STEP_REPORT_S = 0.05
"""How often a decode loop's device process reports its timed steps (a step of SmolLM2 on a CPU core
takes 50-150 ms, so the consumer sees each within about a step)."""


class DeviceProcessDied(RuntimeError):
    """The child running a batch exited before answering."""


class BatchFailed(RuntimeError):
    """The child's runner raised on a batch (its text says what)."""


def serve_batches(conn: Connection) -> None:
    """The child: load the in-process runner the first message names, then answer one batch per message until EOF."""
    try:
        model: ModelConfig = conn.recv()
        runner = make_runner(model)
        runner.load()
    except Exception as e:
        conn.send(("error", describe_error(e)))
        return
    freeze_heap()
    conn.send(("ready", None))
    if getattr(runner, "iteration", None) is not None:
        _serve_concurrently(conn, runner)
        return
    while True:
        try:
            reqs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer: tuple[str, Any] = ("ok", (runner.run(reqs), runner.device_memory()))
        except Exception as e:
            answer = ("error", describe_error(e))
        try:
            conn.send(answer)
        except OSError:  # the consumer is gone: nobody to answer
            return


def _serve_concurrently(conn: Connection, runner: Runner) -> None:
    """Iteration-level batching: every batch in flight joins the one running set, so
    batches are answered as they finish (tagged), not one after another; the decode
    loop's timed steps go to the parent every STEP_REPORT_S (`_report_steps`)."""
    send_lock = threading.Lock()
    threading.Thread(target=_report_steps, args=(conn, runner, send_lock), name="steps", daemon=True).start()

    def answer(tag: int, reqs: list[Request]) -> None:
        try:
            reply: tuple[str, int, Any] = ("ok", tag, (runner.run(reqs), runner.device_memory()))
        except Exception as e:
            reply = ("error", tag, describe_error(e))
        with send_lock:
            try:
                conn.send(reply)
            except OSError:
                return

    while True:
        try:
            tag, reqs = conn.recv()
        except (EOFError, OSError):
            return
        threading.Thread(target=answer, args=(tag, reqs), name=f"batch-{tag}", daemon=True).start()


def _report_steps(conn: Connection, runner: Runner, send_lock: threading.Lock) -> None:
    """Send the decode loop's plain steps timed since the last report, as ("steps", 0, [(rows, ms)]),
    while the parent listens."""
    timed = getattr(runner, "timed_steps", None)
    while timed is not None:
        time.sleep(STEP_REPORT_S)
        steps = timed()
        if not steps:
            continue
        with send_lock:
            try:
                conn.send(("steps", 0, steps))
            except OSError:
                return


class _Child:
    """One device process, started as `python -m` on a socket pair (no re-import of the parent's main)."""

    def __init__(self, model: ModelConfig, index: int) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.name = f"batchtide-device-{model.name}-{index}"
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env
            )
        self.conn = Connection(ours.detach())
        self.conn.send(model)
        kind, payload = self._receive()
        if kind != "ready":
            self.close()
            raise RuntimeError(f"model {model.name!r} failed to load in its device process: {payload}")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and not self.conn.closed

    def run(self, reqs: list[Request]) -> tuple[list[Output], tuple[int, MemoryKind]]:
        try:
            self.conn.send(reqs)
        except OSError:
            raise self._died() from None
        kind, payload = self._receive()
        if kind == "error":
            raise BatchFailed(payload)
        outputs: tuple[list[Output], tuple[int, MemoryKind]] = payload
        return outputs

    def _receive(self) -> tuple[str, Any]:
        try:
            message: tuple[str, Any] = self.conn.recv()
            return message
        except (EOFError, OSError):
            raise self._died() from None

    def _died(self) -> DeviceProcessDied:
        self.conn.close()
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return DeviceProcessDied(f"device process {self.name} exited with code {code}")

    def close(self, timeout_s: float = 10.0) -> None:
        self.conn.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _SharedChild(_Child):
    """One device process that several batches use at once (iteration-level batching)."""

    def __init__(self, model: ModelConfig, index: int) -> None:
        super().__init__(model, index)
        self._waiting: dict[int, Future[tuple[list[Output], tuple[int, MemoryKind]]]] = {}
        self.timed: deque[tuple[int, float]] = deque(maxlen=TIMED_KEPT)
        """The decode loop's timed steps the child reported, not yet taken (`ProcessRunner.timed_steps`)."""
        self._send_lock = threading.Lock()
        self._tags = 0
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        self._reader.start()

    def run(self, reqs: list[Request]) -> tuple[list[Output], tuple[int, MemoryKind]]:
        future: Future[tuple[list[Output], tuple[int, MemoryKind]]] = Future()
        with self._send_lock:
            self._tags += 1
            tag = self._tags
            self._waiting[tag] = future
            try:
                self.conn.send((tag, reqs))
            except OSError:
                self._waiting.pop(tag, None)
                raise self._died() from None
        return future.result()

    def _read(self) -> None:
        while True:
            try:
                kind, tag, payload = self.conn.recv()
            except (EOFError, OSError):
                break
            if kind == "steps":
                self.timed.extend(payload)
                continue
            future = self._waiting.pop(tag, None)
            if future is None:
                continue
            if kind == "error":
                future.set_exception(BatchFailed(payload))
            else:
                future.set_result(payload)
        error = self._died()
        with self._send_lock:
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            future.set_exception(error)


class ProcessRunner:
    """A runner whose `run()` executes in one of `slots` child processes."""

    def __init__(self, model: ModelConfig, front: Runner, slots: int) -> None:
        self.name = front.name
        self.simulated = front.simulated
        self._model = model
        self._front = front
        self._shared = model.batching == "iteration" and model.runner == "transformers"
        """One child serves every in-flight batch (they join one running set), not one child per slot."""
        self._slots = 1 if self._shared else slots
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self._memory = threading.local()
        self._started = 0

    def load(self) -> None:
        self._front.load()
        with self._lock:
            while self._started < self._slots:
                self._idle.put(self._spawn())

    def _spawn(self) -> _Child:
        kind = _SharedChild if self._shared else _Child
        child = kind(self._model, self._started)
        self._started += 1
        self._children.append(child)
        return child

    def _replace(self, dead: _Child) -> _Child:
        """A fresh child for a dead one (if starting it fails, the dead one stays queued and is retried)."""
        with self._lock:
            if dead in self._children:
                self._children.remove(dead)
            child = self._spawn()
        log.warning("started device process %s for model %s after %s died", child.name, self.name, dead.name)
        return child

    def measure(self, req: Request) -> tuple[int, int]:
        return self._front.measure(req)

    def check(self, req: Request) -> str | None:
        return self._front.check(req)

    def run(self, reqs: list[Request]) -> list[Output]:
        if not reqs:
            return []
        self.load()
        prepare = getattr(self._front, "with_token_ids", None)
        shipped = prepare(reqs) if prepare is not None else reqs
        if self._shared:
            outputs, memory = self._run_shared(shipped)
            self._memory.last = memory
            return outputs
        child = self._idle.get()
        try:
            if not child.alive:
                child = self._replace(child)
            outputs, memory = child.run(shipped)
        finally:
            self._idle.put(child)
        self._memory.last = memory
        return outputs

    def _run_shared(self, reqs: list[Request]) -> tuple[list[Output], tuple[int, MemoryKind]]:
        with self._lock:
            child = self._children[-1]
        if not child.alive:
            child = self._replace_shared(child)
        return child.run(reqs)

    def _replace_shared(self, dead: _Child) -> _Child:
        with self._lock:
            if self._children and self._children[-1] is not dead and self._children[-1].alive:
                return self._children[-1]  # another batch restarted it already
        return self._replace(dead)

    def device_memory(self) -> tuple[int, MemoryKind]:
        return getattr(self._memory, "last", (0, "none"))

    def timed_steps(self) -> list[tuple[int, float]]:
        """The decode loop's plain steps (rows, ms) its device process timed and reported since the
        last call (iteration-level batching; none otherwise)."""
        with self._lock:
            children = [c for c in self._children if isinstance(c, _SharedChild)]
        taken: list[tuple[int, float]] = []
        for child in children:
            while child.timed:
                taken.append(child.timed.popleft())
        return taken

    def close(self) -> None:
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            child.close()
        self._front.close()


if __name__ == "__main__":
    # the parent decides when to stop (it closes the socket); a terminal's ^C or a
    # group SIGTERM must not kill batches the consumer is still draining
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serve_batches(Connection(int(sys.argv[1])))
