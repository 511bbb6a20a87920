"""How much of the machine's CPU went to processes outside a process tree over a stretch of time.

A measurement that sizes itself to the machine (the demo's calibration) cannot
tell a slow machine from a busy one: with a CPU hog beside it, it measures
less, sizes its load down, and passes. Reading the kernel's counters tells
them apart: the machine's busy CPU time (all cores, from /proc/stat) less the
CPU time of the run's own process tree (its live processes, and the children
they reaped) is what everything else took. Counters, not a sampling thread:
two samples bound a window, so nothing runs in between.
"""

from __future__ import annotations

import os
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
