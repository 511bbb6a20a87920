"""The recorded device, moment by moment: what a replayed batch costs at the time it runs.

A recording stamps every batch: when it was dispatched, how long it computed,
how long it waited between dispatch and the start of compute (the thread hop,
tokenising) and how long its answers took to be published after compute. On
a shared machine the device's speed changes from second to second (other
processes take the cores), so one curve, or the recorded times of a size
replayed in any order, moves a slow stretch to where it did not happen. Here
each recorded batch gives the device's speed from its start of compute to
the next one's (measured time / the curve's time at its size), and a
replayed batch computes through that piecewise speed: its curve time is
spent at each stretch's pace, so a slow stretch stays where it happened
whatever size runs then, and a long batch averages over the stretches it
spans instead of taking one moment's speed for all of it. A batch dispatched
at virtual time t on a lane also draws one of the recorded batches running
on that lane near t (within `near_ms`, else the nearest) and takes its start
gap (the device is held for it) and its publish gap (added to its requests'
latency). Draws are seeded: several replays with different seeds show the
spread of a prediction.

The curve the speeds are measured against is one affine fit of the recorded
times (`speed_curve`), not the median per size: a size that ran once, in a
slow moment, would otherwise carry that moment to wherever the replay uses it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from pipeline.core.config import CostUnit
from pipeline.core.sim.device_curve import DeviceCurve

NEAR_MS = 250.0
"""Recorded batches running this close to a replayed one's dispatch are its candidates."""


FIT_SAMPLES = 3
"""Batches a size needs to enter the fit (when two sizes have that many): one that ran
once or twice tells its moment's speed more than the device's curve."""


def speed_curve(x: np.ndarray, compute_ms: np.ndarray) -> DeviceCurve | None:
    """t(x) = a + c x fitted to the median time per recorded size, weighted by how often
    the size ran (None: fewer than two sizes, or no positive slope to fit)."""
    ok = (x > 0) & (compute_ms > 0)
    sizes = np.unique(x[ok])
    if sizes.size < 2:
        return None
    medians = np.array([np.median(compute_ms[ok][x[ok] == v]) for v in sizes])
    weights = np.array([np.sum(x[ok] == v) for v in sizes], dtype=float)
    sampled = weights >= FIT_SAMPLES
    if sampled.sum() >= 2:
        sizes, medians, weights = sizes[sampled], medians[sampled], weights[sampled]
    mean_x = np.average(sizes, weights=weights)
    mean_t = np.average(medians, weights=weights)
    spread = np.sum(weights * (sizes - mean_x) ** 2)
    slope = np.sum(weights * (sizes - mean_x) * (medians - mean_t)) / spread if spread > 0 else 0.0
    if slope <= 0:
        return None
    intercept = max(0.0, mean_t - slope * mean_x)
    return DeviceCurve(a_ms=float(intercept), c_ms=float(slope))


@dataclass(frozen=True)
class LaneStamps:
    """One lane's recorded batches, ordered by dispatch (ms from the replay's start)."""

    dispatch_ms: np.ndarray
    end_ms: np.ndarray
    """Dispatch + start gap + compute: when the batch freed its device."""
    start_ms: np.ndarray
    """Dispatch + start gap: where the batch's speed starts to hold (until the next start)."""
    speed: np.ndarray
    """Measured compute time / the curve's time at the batch's size."""
    start_gap_ms: np.ndarray
    publish_gap_ms: np.ndarray


@dataclass(frozen=True)
class BatchTime:
    """What one replayed batch costs: compute, the wait before it, the publish after it."""

    compute_ms: float
    start_gap_ms: float
    publish_gap_ms: float


def lane_stamps(
    curve: DeviceCurve,
    x: np.ndarray,
    dispatch_ms: np.ndarray,
    compute_ms: np.ndarray,
    start_gap_ms: np.ndarray,
    publish_gap_ms: np.ndarray,
) -> LaneStamps:
    """Stamps of one lane from recorded batches (`x`: size or cost in the curve's unit);
    batches without a compute time are left out, unknown gaps count as 0."""
    ok = (x > 0) & (compute_ms > 0)
    order = np.argsort(dispatch_ms[ok], kind="stable")
    expected = np.array([curve.ms(float(v)) for v in x[ok]], dtype=float)
    speed = compute_ms[ok] / np.maximum(expected, 1e-9)
    start = np.nan_to_num(start_gap_ms[ok][order], nan=0.0).clip(min=0.0)
    return LaneStamps(
        dispatch_ms=dispatch_ms[ok][order],
        end_ms=dispatch_ms[ok][order] + start + compute_ms[ok][order],
        start_ms=dispatch_ms[ok][order] + start,
        speed=speed[order],
        start_gap_ms=start,
        publish_gap_ms=np.nan_to_num(publish_gap_ms[ok][order], nan=0.0).clip(min=0.0),
    )


class Timeline:
    """The recorded speed and gaps of each lane's device over the window (see the module doc)."""

    def __init__(
        self,
        curve: DeviceCurve,
        unit: CostUnit,
        lanes: list[LaneStamps],
        *,
        seed: int = 0,
        speed: bool = True,
        start_gap: bool = True,
        publish_gap: bool = True,
        near_ms: float = NEAR_MS,
    ) -> None:
        self.curve = curve
        self.unit = unit
        self._lanes = lanes
        self._rng = np.random.default_rng(seed)
        self.speed = speed
        self.start_gap = start_gap
        self.publish_gap = publish_gap
        self._near_ms = near_ms
        self._pace = [
            (
                stamps.start_ms.tolist(),
                stamps.speed.tolist(),
                float(np.median(stamps.speed)) if stamps.speed.size else 1.0,
            )
            for stamps in lanes
        ]

    @property
    def parts(self) -> tuple[str, ...]:
        """The recorded parts this timeline adds to the curve, for the report."""
        named = (("device speed", self.speed), ("start gap", self.start_gap), ("publish gap", self.publish_gap))
        return tuple(name for name, on in named if on)

    def reseeded(self, seed: int) -> Timeline:
        return Timeline(
            self.curve,
            self.unit,
            self._lanes,
            seed=seed,
            speed=self.speed,
            start_gap=self.start_gap,
            publish_gap=self.publish_gap,
            near_ms=self._near_ms,
        )

    def _draw(self, lane: int, now_ms: float) -> int:
        stamps = self._lanes[lane]
        times = stamps.dispatch_ms
        # batches of one lane run one after another: those running within near_ms of
        # now end after now - near_ms and start before now + near_ms
        lo = int(np.searchsorted(np.maximum.accumulate(stamps.end_ms), now_ms - self._near_ms, side="left"))
        hi = int(np.searchsorted(times, now_ms + self._near_ms, side="right"))
        if hi > lo:
            return int(self._rng.integers(lo, hi))
        nearest = int(np.searchsorted(times, now_ms))
        if nearest >= len(times):
            return len(times) - 1
        if nearest > 0 and now_ms - times[nearest - 1] < times[nearest] - now_ms:
            return nearest - 1
        return nearest

    def _compute_ms(self, lane: int, start_ms: float, work_ms: float) -> float:
        """Time to compute `work_ms` of curve time from `start_ms` at the recorded pace
        (past the recording: its median speed)."""
        starts, speeds, median = self._pace[lane]
        i = bisect.bisect_right(starts, start_ms) - 1
        t, left = start_ms, work_ms
        while True:
            speed = speeds[i] if 0 <= i < len(starts) else (speeds[0] if i < 0 else median)
            end = starts[i + 1] if i + 1 < len(starts) else math.inf
            if (end - t) >= left * speed:
                return t + left * speed - start_ms
            left -= (end - t) / speed
            t, i = end, i + 1

    def batch(self, lane: int, size: int, tokens: int, now_ms: float) -> BatchTime:
        """The time a batch of `size` requests (`tokens` in all) dispatched at `now_ms` takes."""
        base = self.curve.ms(float(tokens if self.unit == "tokens" else size))
        stamps = self._lanes[lane] if lane < len(self._lanes) else None
        if stamps is None or stamps.dispatch_ms.size == 0:
            return BatchTime(base, 0.0, 0.0)
        k = self._draw(lane, now_ms)
        gap = float(stamps.start_gap_ms[k]) if self.start_gap else 0.0
        return BatchTime(
            compute_ms=self._compute_ms(lane, now_ms + gap, base) if self.speed else base,
            start_gap_ms=gap,
            publish_gap_ms=float(stamps.publish_gap_ms[k]) if self.publish_gap else 0.0,
        )
