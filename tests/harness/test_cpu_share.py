"""The CPU other processes took: a process outside the tree counts as other, a child as the tree's own.

Figures in CPU seconds, which a loaded machine does not shrink: other processes on the machine only
add to what is counted as other, so the bounds hold however busy it is.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.tools.harness import cpu_share
from pipeline.tools.harness.cpu_share import CpuSample

BURN = "import time\nx = 0\nfor i in range(6_000_000):\n    x += i\nprint(time.process_time())"
"""A child that spends a few tenths of a CPU second and says how many."""


def _burn() -> float:
    return float(subprocess.run([sys.executable, "-c", BURN], capture_output=True, text=True, check=True).stdout)


def test_the_share_is_what_the_machine_spent_less_the_tree_over_its_cores() -> None:
    start = CpuSample(at_s=100.0, busy_s=500.0, tree_s=50.0, cpus=2)
    end = CpuSample(at_s=110.0, busy_s=512.0, tree_s=53.0, cpus=2)
    assert cpu_share.other_share(start, end) == pytest.approx((12.0 - 3.0) / 20.0)
    all_ours = CpuSample(at_s=110.0, busy_s=512.0, tree_s=62.5, cpus=2)
    assert cpu_share.other_share(start, all_ours) == 0.0, "clock ticks can put the tree a little over the machine"
    assert cpu_share.other_share(start, start) == 0.0


def _samples(others_per_s: list[float], cpus: int = 2) -> list[CpuSample]:
    """One sample a second; other processes spending the given CPU seconds in each second."""
    samples, busy = [CpuSample(0.0, 0.0, 0.0, cpus)], 0.0
    for k, spent in enumerate(others_per_s, 1):
        busy += spent
        samples.append(CpuSample(float(k), busy, 0.0, cpus))
    return samples


def test_the_worst_stretch_finds_a_spell_the_whole_window_hides() -> None:
    samples = _samples([0.02] * 40 + [1.6] * 10 + [0.02] * 10)  # ten seconds of 80% of two cores
    whole = cpu_share.other_share(samples[0], samples[-1])
    assert whole == pytest.approx((0.02 * 50 + 16.0) / 120.0)
    assert cpu_share.worst_share(samples, 10.0) == pytest.approx(0.8)
    assert cpu_share.worst_share(samples, 60.0) == pytest.approx(whole)
    short = samples[:6]
    assert cpu_share.worst_share(short, 10.0) == pytest.approx(0.01), "shorter than the span: the whole"
    assert cpu_share.worst_share(samples[:1], 10.0) == 0.0


def test_a_watch_keeps_its_samples_in_order_between_two_marks() -> None:
    watch = cpu_share.CpuWatch(every_s=0.01).start()
    try:
        first = watch.mark()
        _burn()
        last = watch.mark()
    finally:
        watch.stop()
    kept = watch.between(first, last)
    assert kept[0] == first and kept[-1] == last and len(kept) >= 3, "the thread sampled in between"
    assert [s.at_s for s in kept] == sorted(s.at_s for s in kept)


def test_a_finished_child_counts_as_the_trees_own() -> None:
    before = cpu_share.sample()
    spent = _burn()
    after = cpu_share.sample()
    assert after.tree_s - before.tree_s >= 0.9 * spent - 0.02


def test_a_process_outside_the_tree_counts_as_other() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = cpu_share.sample(sleeper.pid)
        spent = _burn()  # this test's child, not the sleeper's: outside the sampled tree
        after = cpu_share.sample(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    other_s = (after.busy_s - before.busy_s) - (after.tree_s - before.tree_s)
    assert other_s >= 0.9 * spent - 0.02
    assert cpu_share.other_share(before, after) > 0.0
