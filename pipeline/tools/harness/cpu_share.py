"""How much of the machine's CPU went to processes outside a process tree over a stretch of time.

A measurement that sizes itself to the machine (the demo's calibration) cannot
tell a slow machine from a busy one: with a CPU hog beside it, it measures
less, sizes its load down, and passes. Reading the kernel's counters tells
them apart: the machine's busy CPU time (all cores, from /proc/stat) less the
CPU time of the run's own process tree (its live processes, and the children
they reaped) is what everything else took. A tail latency is made in a few
seconds, so a window is judged by its busiest stretch too: `CpuWatch` samples
the counters once a second in a thread, and `worst_share` reads the busiest
stretch of a given length from the samples.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class CpuSample:
    """The kernel's CPU counters at one moment."""

    at_s: float
    """Monotonic clock, seconds."""
    busy_s: float
    """CPU seconds the machine spent not idle, summed over its cores, since boot."""
    tree_s: float
    """CPU seconds the process tree spent (user + system, reaped children included)."""
    cpus: int


def _machine_busy_s() -> float:
    t = psutil.cpu_times()
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # already counted in user and nice
    total = sum(t) - guest
    return total - t.idle - getattr(t, "iowait", 0.0)


def _process_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def sample(root_pid: int | None = None) -> CpuSample:
    """The counters now; the tree is `root_pid` (default: this process) and its descendants. A child
    that ends between two samples moves its time into its parent's children counters once reaped, so
    the difference of two samples still counts it once."""
    root = psutil.Process(root_pid or os.getpid())
    tree = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            tree += _process_s(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return CpuSample(time.monotonic(), _machine_busy_s(), tree, psutil.cpu_count() or 1)


def other_share(start: CpuSample, end: CpuSample) -> float:
    """Share of the machine's CPU (all cores over the window) that processes outside the tree took
    between two samples, in [0, 1]."""
    capacity = end.cpus * (end.at_s - start.at_s)
    if capacity <= 0:
        return 0.0
    other = (end.busy_s - start.busy_s) - (end.tree_s - start.tree_s)
    return min(max(other / capacity, 0.0), 1.0)


def worst_share(samples: list[CpuSample], span_s: float) -> float:
    """The highest `other_share` over the stretches from each sample to the first one at least `span_s`
    after it; the whole window's share when the samples span less than `span_s`."""
    if len(samples) < 2:
        return 0.0
    if samples[-1].at_s - samples[0].at_s < span_s:
        return other_share(samples[0], samples[-1])
    worst, j = 0.0, 0
    for start in samples:
        while j < len(samples) and samples[j].at_s - start.at_s < span_s:
            j += 1
        if j == len(samples):
            break
        worst = max(worst, other_share(start, samples[j]))
    return worst


class CpuWatch:
    """The counters sampled every `every_s` seconds by a daemon thread from `start` to `stop`, and on
    demand (`mark`), so a window can be judged by its whole and its busiest stretch afterwards."""

    def __init__(self, every_s: float = 1.0, root_pid: int | None = None) -> None:
        self.every_s = every_s
        self.root_pid = root_pid
        self._samples: list[CpuSample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)

    def start(self) -> CpuWatch:
        self.mark()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.mark()

    def mark(self) -> CpuSample:
        """A sample now, kept with the others; its `at_s` bounds a window."""
        now = sample(self.root_pid)
        with self._lock:
            self._samples.append(now)
        return now

    def between(self, start: CpuSample, end: CpuSample) -> list[CpuSample]:
        """The samples from `start` to `end`, both included."""
        with self._lock:
            kept = [s for s in self._samples if start.at_s <= s.at_s <= end.at_s]
        return sorted(kept, key=lambda s: s.at_s)
