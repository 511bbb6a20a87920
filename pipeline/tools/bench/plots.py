"""PNG plots of a policy bench: latency CDF per policy, batch size histogram, window over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from pipeline.core.sim.search import Evaluation
from pipeline.tools.bench.policy import PolicyBench


def _served_latency(row: Evaluation) -> np.ndarray:
    o = row.outcome
    served = ~o.expired & ~np.isnan(o.done_ms)
    latency: np.ndarray = (o.done_ms - o.arrivals.create_ms)[served]
    return latency


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_plots(bench: PolicyBench, directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    name = bench.scenario.name
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for row in bench.rows:
        lat = np.sort(_served_latency(row))
        if lat.size:
            ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=row.candidate.family, linewidth=1.2)
    ax.axvline(bench.scenario.slo_p99_ms, color="grey", linestyle=":", label="SLO")
    ax.set_xscale("log")
    ax.set_ylim(0.5, 1.001)
    ax.set_xlabel("end-to-end latency (ms, log)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"{name}: latency CDF at nominal load (upper half)")
    ax.legend(fontsize=7, ncol=2)
    written.append(_save(fig, out / f"{name}-latency-cdf.png"))

    fig, ax = plt.subplots(figsize=(9, 5.5))
    sizes = [np.asarray(r.outcome.batches.size) for r in bench.rows]
    top = max((int(s.max()) for s in sizes if s.size), default=1)
    bins = np.arange(0.5, top + 1.5, max(1, top // 40))
    for row, s in zip(bench.rows, sizes, strict=True):
        if s.size:
            ax.hist(s, bins=bins.tolist(), histtype="step", label=row.candidate.family, density=True)
    ax.set_xlabel("batch size")
    ax.set_ylabel("share of batches")
    ax.set_title(f"{name}: batch size distribution at nominal load")
    ax.legend(fontsize=7, ncol=2)
    written.append(_save(fig, out / f"{name}-batch-sizes.png"))

    fig, (ax, cap_ax) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    for row in bench.rows:
        log = row.outcome.batches
        if not log.dispatch_ms:
            continue
        t = np.asarray(log.dispatch_ms) / 1000.0
        keys, idx = np.unique(np.floor(t * 4) / 4, return_inverse=True)
        counts = np.bincount(idx)
        ax.plot(
            keys,
            np.bincount(idx, weights=np.asarray(log.window_ms)) / counts,
            label=row.candidate.family,
            linewidth=1.0,
        )
        cap_ax.plot(
            keys,
            np.bincount(idx, weights=np.asarray(log.effective_cap, dtype=float)) / counts,
            label=row.candidate.family,
            linewidth=1.0,
        )
    ax.set_ylabel("window (ms, mean per 250 ms)")
    ax.set_title(f"{name}: batching window and effective cap over time (DispatchRecord)")
    ax.legend(fontsize=7, ncol=2)
    cap_ax.set_ylabel("effective cap")
    cap_ax.set_xlabel("time (s)")
    written.append(_save(fig, out / f"{name}-window.png"))
    return written
