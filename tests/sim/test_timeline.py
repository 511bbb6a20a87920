"""The recorded device moment by moment (pipeline/core/sim/timeline.py) and the simulator under it."""

import numpy as np

from pipeline.core.config import BatchProfile
from pipeline.core.engine import BatchingEngine
from pipeline.core.sim.arrivals import Arrivals
from pipeline.core.sim.device_curve import DeviceCurve
from pipeline.core.sim.scenario_file import parse_scenario
from pipeline.core.sim.simulator import conservation_problems, simulate
from pipeline.core.sim.timeline import Timeline, lane_stamps, speed_curve

CURVE = DeviceCurve(a_ms=0.0, c_ms=10.0)


def recorded_lane(start_gap_ms: float = 0.0, publish_gap_ms: float = 0.0):
    """Batches of 4 every 100 ms for 5 s; between 2 and 3 s the device ran 3x slower."""
    dispatch = np.arange(0.0, 5000.0, 100.0)
    compute = np.where((dispatch >= 2000.0) & (dispatch < 3000.0), 120.0, 40.0)
    n = dispatch.size
    return lane_stamps(CURVE, np.full(n, 4.0), dispatch, compute, np.full(n, start_gap_ms), np.full(n, publish_gap_ms))


def test_a_batch_runs_at_the_speed_recorded_at_its_moment_whatever_its_size() -> None:
    for seed in range(5):
        timeline = Timeline(CURVE, "requests", [recorded_lane()], seed=seed)
        assert timeline.batch(0, 8, 8, 500.0).compute_ms == 80.0
        assert timeline.batch(0, 8, 8, 2500.0).compute_ms == 240.0
        assert timeline.batch(0, 2, 2, 4000.0).compute_ms == 20.0
    assert Timeline(CURVE, "requests", [recorded_lane()], speed=False).batch(0, 8, 8, 2500.0).compute_ms == 80.0


def test_past_the_recording_the_nearest_batch_answers() -> None:
    timeline = Timeline(CURVE, "requests", [recorded_lane()])
    assert timeline.batch(0, 8, 8, 60_000.0).compute_ms == 80.0
    assert timeline.parts == ("device speed", "start gap", "publish gap")


def test_speed_curve_is_one_line_not_a_slow_moment_per_size() -> None:
    x = np.array([1, 1, 1, 2, 2, 2, 4, 4, 16], dtype=float)
    t = np.array([12, 11, 13, 22, 21, 23, 41, 43, 480], dtype=float)
    curve = speed_curve(x, t)
    assert curve is not None
    assert 150.0 < curve.ms(16) < 250.0, "the one slow batch of 16 does not make 16 slow"
    assert speed_curve(np.array([4.0, 4.0]), np.array([40.0, 41.0])) is None


def test_the_device_is_held_for_the_start_gap_and_answers_leave_after_the_publish_gap() -> None:
    scenario = parse_scenario(
        {
            "name": "timeline",
            "seed": 1,
            "slo_p99_ms": 10_000.0,
            "phases": [{"duration_s": 5, "rate_per_s": 100}],
            "cost": {"a_ms": 0.0, "c_ms": 10.0},
        }
    )
    n = 500
    create = np.arange(n, dtype=float) * 10.0
    arrivals = Arrivals(
        create, create.copy(), np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    )
    timeline = Timeline(CURVE, "requests", [recorded_lane(start_gap_ms=15.0, publish_gap_ms=7.0)])
    engine = BatchingEngine(BatchProfile(hard_cap=8, target_size=8, max_wait_ms=0.0, min_wait_ms=0.0))
    out = simulate(scenario, arrivals, [engine], timeline=timeline)
    assert conservation_problems(out) == []
    log = out.batches
    for k in range(1, len(log.size)):
        assert log.dispatch_ms[k] >= log.dispatch_ms[k - 1] + 15.0 + log.compute_ms[k - 1] - 1e-9
    served = ~out.expired
    spent = out.done_ms[served] - out.dispatch_ms[served]
    by_dispatch = dict(zip(log.dispatch_ms, log.compute_ms, strict=True))
    expected = np.array([15.0 + by_dispatch[d] + 7.0 for d in out.dispatch_ms[served]])
    assert np.allclose(spent, expected)
    slow = [c / s for d, s, c in zip(log.dispatch_ms, log.size, log.compute_ms, strict=True) if 2250.0 <= d < 2700.0]
    assert slow and all(abs(v - 30.0) < 1e-9 for v in slow), "the slow stretch is replayed where it happened"
