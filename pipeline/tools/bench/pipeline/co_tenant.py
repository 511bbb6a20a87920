"""A co-tenant: a busy process pinned to one core, so the consumer pinned there really runs slower.

A fleet's slow member in the real world is an older card, a throttled one or
one that shares its device with another model. On a CPU host the last is
what can be made honestly: a process that does nothing but spin, pinned to
the core a consumer is pinned to, takes about half of that core from the
consumer's decode loop (the kernel shares a core between runnable threads),
so the real model's steps take about twice as long. Nothing in the consumer
is told or simulated.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.tools.harness.processes import Proc

SPIN = "while True:\n    pass\n"


class CoTenant:
    """A spinning process on `core`, started and stopped on demand (again and again)."""

    def __init__(self, core: int, log_dir: Path) -> None:
        self.core = core
        self._proc = Proc(
            f"co-tenant-{core}", [sys.executable, "-c", SPIN], log_dir, death_signal="KILL", cores=(core,)
        )

    @property
    def running(self) -> bool:
        return self._proc.alive

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def start(self) -> None:
        if not self._proc.alive:
            self._proc.start()

    def stop(self) -> None:
        self._proc.kill()
