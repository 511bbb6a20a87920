"""What generation costs on a simulated device: a prefill per group of prompts, a decode step per
running set.

A static batch's t(b) cannot describe iteration-level batching: there a request's time is
the prefills and decode steps of a running set that other requests join and leave. This
charges the two operations the decode loop really runs, from the curves `batchtide profile`
measured (pipeline/core/profile_file.py, `GenerationCurves`):

- prefill of a group: a line over the group's padded prompt tokens (rows x the longest
  prompt: prompts are left-padded to one width), fitted by least squares to the measured
  prefills: its work grows with the tokens, and one prefill measured while another process
  held the core (2.8 s at 256 tokens between 0.8 s at 128 and 3.6 s at 512, here) must not
  make every join of that size look slow;
- a ride in a decode step (chunked prefill): a fixed part (`ride_fixed_ms`) and a part per
  prompt token, the model the consumer's pacer fits to its rides and paces them by. From a
  profile, the prefill line's slope (what a token adds to a forward pass on a device whose passes
  are bound by their tokens, a CPU) and no fixed part: a profile does not measure rides, and the
  prefill line's intercept as the fixed part made the replay's calibration of a recording find
  a device 20x off (the recording's pace holds the fixed part: `ride_measured_ms`);
- one decode step: the step curve at the rows in the cache (finished rows not yet compacted
  away count: they are decoded too) plus attention over the cache, `per_row_token_ms` per row
  and cache token past the profiled cache length. That slope is taken from the steps the
  profile measured at a longer cache (the longest admissible request).

`scale` multiplies both: a device that ran slower than when it was profiled (cores shared
with other processes) is the same device, slower. `step_overhead_ms` is added to every decode
step, unscaled: what a live loop pays per step that a profile measured alone does not (the
decode thread sharing the interpreter with the consumer's event loop, the loop's own
bookkeeping); the replay measures it from a recording (replay_generation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.core.profile_file import GenerationCurves
from pipeline.core.sim.device_curve import DeviceCurve


@dataclass(frozen=True)
class GenerationCost:
    prefill: DeviceCurve
    """ms of one prefill over the padded prompt tokens of its group."""
    step: DeviceCurve
    """ms of one decode step over the rows in the cache, at `ref_cache` tokens."""
    ref_cache: float
    """Cache length (tokens per row) the step curve was measured at."""
    per_row_token_ms: float = 0.0
    """Attention: ms per row and per cache token past `ref_cache`."""
    scale: float = 1.0
    step_overhead_ms: float = 0.0
    """ms every decode step pays whatever its rows (not scaled)."""
    ride_ms_per_token: float | None = None
    """ms a prompt token riding in a decode step adds to it, as the consumer's pacer measures it
    (chunked_prefill.RidePacer); None: a chunk of the step's token budget adds RIDE_SHARE of the
    step (chunks.py), the rule for a device whose step is bound by reading the weights."""
    ride_measured_ms: float | None = None
    """ms per ridden prompt token measured on a recording (the pace its loop admitted joiners at);
    not scaled, and taken over `ride_ms_per_token`."""
    ride_fixed_ms: float = 0.0
    """ms a ride adds to its decode step whatever it carries, beside `ride_ms_per_token` a token
    (the consumer's pacer fits both: chunked_prefill.RidePacer). A pace measured on a recording
    (`ride_measured_ms`) already holds it."""

    def prefill_ms(self, rows: int, width: int) -> float:
        return self.scale * self.prefill.ms(rows * width)

    def step_ms(self, rows: int, cache: int) -> float:
        base = self.step.ms(rows)
        attention = self.per_row_token_ms * rows * (cache - self.ref_cache)
        return self.scale * max(0.5 * base, base + attention) + self.step_overhead_ms

    def ride_token_ms(self) -> float | None:
        if self.ride_measured_ms is not None:
            return self.ride_measured_ms
        return None if self.ride_ms_per_token is None else self.scale * self.ride_ms_per_token

    def ride_fixed(self) -> float:
        """ms a ride adds to its step beside `ride_token_ms` a token (0 without a per-token price)."""
        if self.ride_measured_ms is not None or self.ride_ms_per_token is None:
            return 0.0
        return self.scale * self.ride_fixed_ms

    def prompt_token_ms(self) -> float:
        """ms a prompt token costs at least, in a ride or a prefill of its own: the ride price when one
        is known, else the prefill curve's slope (no fixed part)."""
        ride = self.ride_token_ms()
        if ride:
            return ride
        return self.scale * max(0.0, self.prefill.ms(2048) - self.prefill.ms(1024)) / 1024

    def scaled(self, factor: float) -> GenerationCost:
        return replace(self, scale=self.scale * factor)

    def with_step_overhead(self, ms: float) -> GenerationCost:
        return replace(self, step_overhead_ms=ms)

    @classmethod
    def linear(
        cls,
        prefill_a_ms: float,
        prefill_c_ms: float,
        step_a_ms: float,
        step_c_ms: float,
        per_row_token_ms: float = 0.0,
        ref_cache: float = 0.0,
    ) -> GenerationCost:
        """prefill = a + c x tokens, step = a + c x rows (tests and hand-written scenarios)."""
        return cls(
            DeviceCurve(prefill_a_ms, prefill_c_ms), DeviceCurve(step_a_ms, step_c_ms), ref_cache, per_row_token_ms
        )

    @classmethod
    def from_curves(cls, curves: GenerationCurves) -> GenerationCost:
        steps = sorted(curves.steps)
        if not curves.prefill or not steps:
            raise ValueError("a generation profile needs prefill and decode-step points")
        ref_cache = sum(cache for _, cache, _ in steps) / len(steps)
        step = DeviceCurve(points=tuple((float(rows), ms) for rows, _, ms in steps))
        slopes = []
        for rows, cache, ms in curves.long_steps:
            if cache > ref_cache + 1:
                slopes.append((ms - step.ms(rows)) / (rows * (cache - ref_cache)))
        slope = max(0.0, sorted(slopes)[len(slopes) // 2]) if slopes else 0.0
        prefill = _line(curves.prefill)
        per_token = prefill.c_ms if prefill.c_ms > 0 else None
        return cls(prefill, step, ref_cache, slope, ride_ms_per_token=per_token)


def _line(points: tuple[tuple[int, float], ...]) -> DeviceCurve:
    """Least-squares a + c x over the points, with a >= 0 (through the origin when the free fit's
    intercept is negative) and c >= 0; one point: proportional."""
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    n = len(xs)
    if n < 2:
        return DeviceCurve(0.0, ys[0] / xs[0])
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    a = my - c * mx
    if a < 0:
        a, c = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return DeviceCurve(a, max(c, 0.0))
