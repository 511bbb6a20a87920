"""Scenario files: validation messages a user can act on, arrivals that follow the phases."""

import numpy as np
import pytest

from pipeline.core.sim.arrivals import make_arrivals
from pipeline.core.sim.device_curve import DeviceCurve
from pipeline.core.sim.scenario import ScenarioError
from pipeline.core.sim.scenario_file import parse_scenario

BASE = {
    "name": "t",
    "seed": 3,
    "phases": [{"duration_s": 2, "rate_per_s": 500}],
    "cost": {"a_ms": 5.0, "c_ms": 0.5},
}


def with_(**changes):
    return {**BASE, **changes}


@pytest.mark.parametrize(
    "data, message",
    [
        (with_(phases=[]), "needs at least one [[phases]]"),
        (with_(phases=[{"duration_s": 0, "rate_per_s": 5}]), "phases[0].duration_s: must be > 0"),
        (with_(phases=[{"duration_s": 1, "rate_per_s": 5, "burst": {}}]), "unknown key 'burst'"),
        (
            with_(
                phases=[{"duration_s": 4, "rate_per_s": 5, "bursts": {"every_s": 1, "duration_s": 2, "rate_per_s": 9}}]
            ),
            "duration_s (2.0) is longer than every_s (1.0)",
        ),
        (with_(cost={"a_ms": 1.0}), "missing key 'c_ms'"),
        (with_(cost={"points": [[1, 2.0]]}), "need at least two measured points"),
        (with_(cost={"points": [[1, 2.0], [4, 3.0]], "a_ms": 1.0}), "either points or a_ms/c_ms"),
        (with_(cost={"a_ms": 1.0, "c_ms": 0.1, "unit": "bytes"}), "unit: 'bytes' is not one of"),
        (with_(cost={"a_ms": 1.0, "c_ms": 0.1, "shift_at_s": 3}), "shift_at_s and [cost.shifted] go together"),
        (with_(topology={"mode": "mesh"}), "mode: 'mesh' is not one of"),
        (with_(topology={"mode": "shared-queue", "consumers": 2, "skew": 1.0}), "need mode 'own-queues'"),
        (with_(topology={"mode": "shared-device", "consumers": 2, "model_share": [1.0]}), "one value per model"),
        (with_(priority={"mix": [-1, 2]}), "[priority].mix"),
        (with_(profile_overrides={"hard_cap": 8}), "profile_overrides is not allowed"),
        (with_(tokens={"prompt": {"dist": "zipf"}}), "dist: 'zipf' is not one of"),
        (with_(slo_p99_ms="fast"), "slo_p99_ms: expected a number"),
    ],
)
def test_validation_errors_name_the_key(data, message):
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data, "s.toml")
    assert message in str(err.value)
    assert str(err.value).startswith("s.toml")


def test_interpolated_curve_between_and_beyond_points():
    curve = DeviceCurve(points=((1.0, 10.0), (8.0, 24.0), (16.0, 72.0)))
    assert curve.ms(8) == 24.0
    assert curve.ms(4) == pytest.approx(10.0 + 14.0 * 3 / 7)
    assert curve.ms(12) == pytest.approx(48.0)
    assert curve.ms(32) == pytest.approx(72.0 + 6.0 * 16)
    assert curve.ms(0.5) > 0
    assert DeviceCurve(a_ms=5.0, c_ms=0.5).ms(10) == 10.0


def test_shift_switches_curve_and_limit_uses_the_heavier_curve():
    s = parse_scenario(with_(cost={"a_ms": 2.0, "c_ms": 1.0, "shift_at_s": 1, "shifted": {"a_ms": 4.0, "c_ms": 2.0}}))
    assert s.cost.batch_ms(10, 0, 999.0) == 12.0
    assert s.cost.batch_ms(10, 0, 1000.0) == 24.0
    assert s.cost.physical_limit_rps(10) == pytest.approx(10 / 24.0 * 1000)


def test_tokens_unit_charges_tokens():
    s = parse_scenario(with_(cost={"unit": "tokens", "a_ms": 1.0, "c_ms": 0.01}))
    assert s.cost.batch_ms(3, 300, 0.0) == pytest.approx(4.0)


def test_arrivals_follow_phase_and_burst_rates():
    s = parse_scenario(
        with_(
            phases=[
                {
                    "duration_s": 10,
                    "rate_per_s": 200,
                    "bursts": {"every_s": 5, "duration_s": 1, "rate_per_s": 2000, "offset_s": 2},
                },
            ]
        )
    )
    arr = make_arrivals(s, 1.0)
    t = arr.create_ms
    in_burst = ((t >= 2000) & (t < 3000)) | ((t >= 7000) & (t < 8000))
    assert abs(in_burst.sum() - 4000) < 4 * np.sqrt(4000)
    assert abs((~in_burst).sum() - 1600) < 4 * np.sqrt(1600)
    assert np.all(np.diff(arr.deliver_ms) >= 0)
    double = make_arrivals(s, 2.0)
    assert abs(len(double) / len(arr) - 2.0) < 0.1


def test_a_heavier_load_is_the_same_traffic_denser():
    """Common random numbers: capacity search compares loads, not two independent draws."""
    s = parse_scenario(
        with_(
            phases=[
                {"duration_s": 20, "rate_per_s": 30},
                {"duration_s": 0.5, "rate_per_s": 0},
                {"duration_s": 10, "rate_per_s": 300},
            ],
            tokens={"prompt": {"dist": "uniform", "min": 4, "max": 400}, "output": {"dist": "fixed", "value": 0}},
            priority={"mix": [0.2, 0.8]},
            topology={"mode": "own-queues", "consumers": 3, "skew": 1.0},
        )
    )
    light, heavy = make_arrivals(s, 1.0), make_arrivals(s, 1.37)
    assert len(heavy) > len(light)

    def by_time(a):
        order = np.argsort(a.create_ms, kind="stable")
        return a.create_ms[order], a.tokens[order], a.priority[order], a.lane[order]

    t1, tok1, pri1, lane1 = by_time(light)
    t2, tok2, pri2, lane2 = by_time(heavy)
    n = len(light)
    assert np.all(t2[:n] <= t1 + 1e-9)
    assert np.array_equal(tok2[:n], tok1) and np.array_equal(pri2[:n], pri1) and np.array_equal(lane2[:n], lane1)
    assert not np.any((t2 >= 20000) & (t2 < 20500))
    assert np.array_equal(make_arrivals(s, 1.37).create_ms, heavy.create_ms)


def test_skew_and_fetch_delay_shape_the_lanes():
    s = parse_scenario(with_(topology={"mode": "own-queues", "consumers": 4, "skew": 2.0, "fetch_delay_ms": 30.0}))
    arr = make_arrivals(s, 1.0)
    share0 = float((arr.lane == 0).mean())
    assert share0 == pytest.approx(3 / 6, abs=0.05)
    lag = arr.deliver_ms - arr.create_ms
    assert np.allclose(lag[arr.lane == 0], 30.0)
    assert np.allclose(lag[arr.lane != 0], 0.0)
