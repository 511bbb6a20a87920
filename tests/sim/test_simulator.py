"""The simulator: determinism, conservation, caps, the device model, every topology."""

import numpy as np
import pytest

from pipeline.core.config import BatchProfile
from pipeline.core.engine import BatchingEngine
from pipeline.core.engine.decisions import Decision
from pipeline.core.sim.arrivals import make_arrivals
from pipeline.core.sim.families import PEER_FAMILIES, LaneContext
from pipeline.core.sim.metrics import measure
from pipeline.core.sim.peers import FixedWindow
from pipeline.core.sim.scenario_file import parse_scenario
from pipeline.core.sim.simulator import SimulationError, conservation_problems, simulate


def scenario(**extra):
    data = {
        "name": "unit",
        "seed": 9,
        "slo_p99_ms": 500.0,
        "phases": [
            {"duration_s": 2, "rate_per_s": 800, "bursts": {"every_s": 1, "duration_s": 0.2, "rate_per_s": 3000}}
        ],
        "cost": {"a_ms": 4.0, "c_ms": 0.5},
        "priority": {"mix": [0.3, 0.7]},
    }
    data.update(extra)
    return parse_scenario(data)


def engines(s, **profile):
    return [
        BatchingEngine(BatchProfile(max_inflight_batches=len(s.topology.lane_devices(lane)), **profile))
        for lane in range(s.topology.lanes)
    ]


def test_same_seed_same_results():
    s = scenario()
    runs = [simulate(s, make_arrivals(s), engines(s)) for _ in range(2)]
    assert np.array_equal(runs[0].done_ms, runs[1].done_ms)
    assert runs[0].batches.size == runs[1].batches.size
    assert measure(s, runs[0]) == measure(s, runs[1])


@pytest.mark.parametrize(
    "topology",
    [
        {"mode": "own-queues", "consumers": 3, "skew": 1.0, "fetch_delay_ms": 20.0},
        {"mode": "shared-queue", "consumers": 3},
        {"mode": "shared-device", "consumers": 2, "model_share": [0.6, 0.4], "model_cost_scale": [1.0, 2.0]},
    ],
)
def test_every_arrival_answered_once_in_every_topology(topology):
    s = scenario(topology=topology, deadline_ms=150.0)
    for build in [lambda: engines(s)] + [
        (
            lambda fam=fam: [
                fam.build(fam.grid[len(fam.grid) // 2], LaneContext(len(s.topology.lane_devices(lane)), 2))
                for lane in range(s.topology.lanes)
            ]
        )
        for fam in PEER_FAMILIES
    ]:
        out = simulate(s, make_arrivals(s), build())
        assert conservation_problems(out) == []
        served = ~out.expired
        assert np.all(out.done_ms[served] >= out.dispatch_ms[served])
        assert np.all(out.dispatch_ms[served] >= out.arrivals.create_ms[served])


def test_expired_requests_are_counted_not_run():
    s = scenario(deadline_ms=30.0, cost={"a_ms": 20.0, "c_ms": 1.0})
    out = simulate(s, make_arrivals(s), engines(s))
    m = measure(s, out)
    assert out.expired.sum() > 0
    assert m.expired_share == pytest.approx(out.expired.mean())
    assert sum(out.batches.size) == int((~out.expired).sum())


def test_cap_respected_and_device_serialised():
    s = scenario()
    out = simulate(s, make_arrivals(s), [FixedWindow(5.0, 12)])
    assert max(out.batches.size) <= 12
    starts = np.asarray(out.batches.dispatch_ms)
    ends = starts + np.asarray(out.batches.compute_ms)
    assert np.all(starts[1:] >= ends[:-1] - 1e-9)
    capped = simulate(s, make_arrivals(s), engines(s, target_size=8, hard_cap=10))
    assert max(capped.batches.size) <= 10


def test_compute_time_comes_from_the_cost_model():
    s = scenario(
        cost={"a_ms": 3.0, "c_ms": 0.25, "shift_at_s": 1, "shifted": {"points": [[1, 10.0], [16, 40.0], [64, 400.0]]}}
    )
    out = simulate(s, make_arrivals(s), [FixedWindow(2.0, 32)])
    assert len(out.batches.size) > 0 and max(out.batches.dispatch_ms) >= 1000.0, "batches on both curves"
    for t, size, ms in zip(out.batches.dispatch_ms, out.batches.size, out.batches.compute_ms, strict=True):
        assert ms == pytest.approx(s.cost.curve_at(t).ms(size))


def test_shared_queue_runs_batches_in_parallel():
    s = scenario(topology={"mode": "shared-queue", "consumers": 3}, cost={"a_ms": 20.0, "c_ms": 1.0})
    out = simulate(s, make_arrivals(s), [FixedWindow(0.0, 16, max_inflight=3)])
    starts = np.asarray(out.batches.dispatch_ms)
    ends = starts + np.asarray(out.batches.compute_ms)
    overlap = max(int(((starts <= t) & (ends > t)).sum()) for t in starts)
    assert overlap == 3


class GreedyIgnoringDevice(FixedWindow):
    """Breaks the contract: dispatches even when told the device is busy."""

    def poll(self, now_ms, device_free=True, backlog=0):
        return super().poll(now_ms, True, backlog)

    def can_run(self, device_free):
        return True


class Hoarder(FixedWindow):
    """Breaks the contract: never dispatches and never asks to be woken."""

    def poll(self, now_ms, device_free=True, backlog=0):
        return Decision()


def test_contract_violations_are_reported():
    s = scenario()
    with pytest.raises(SimulationError, match="no free device"):
        simulate(s, make_arrivals(s), [GreedyIgnoringDevice(0.0, 4)])
    with pytest.raises(SimulationError, match="never answered"):
        simulate(s, make_arrivals(s), [Hoarder(0.0, 4)])


def test_abort_stops_early_once_slo_is_lost():
    s = scenario(phases=[{"duration_s": 3, "rate_per_s": 4000}])
    arr = make_arrivals(s)
    out = simulate(s, arr, [FixedWindow(0.0, 4)], abort_over_slo=10)
    assert out.aborted and out.offered < len(arr)


def test_default_engine_gets_the_device_limit_and_the_profile_it_would_have_measured():
    from pipeline.core.sim.search import Candidate, Evaluator

    s = scenario(cost={"a_ms": 4.0, "c_ms": 0.5, "max_batch": 60})
    default = Evaluator(s).policies(Candidate("batchtide-default", {}))[0]
    assert isinstance(default, BatchingEngine)
    assert default.ceiling == 60, "hard_cap auto: the scenario's [cost] max_batch"
    assert [size for size, _ in default.curve.points()] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 60]
    assert default.curve.cap == 60, "affine: the knee is the memory limit"
    unlimited = Evaluator(scenario()).policies(Candidate("batchtide-default", {}))[0]
    assert isinstance(unlimited, BatchingEngine)
    assert unlimited.ceiling == 128
    outcome = simulate(s, make_arrivals(s, 3.0), Evaluator(s).policies(Candidate("batchtide-default", {})))
    assert max(outcome.batches.size) <= 60 and not conservation_problems(outcome)


def test_token_cost_reaches_a_token_unit_engine():
    s = scenario(cost={"unit": "tokens", "a_ms": 4.0, "c_ms": 0.01}, tokens={"prompt": {"dist": "fixed", "value": 100}})
    engine = BatchingEngine(BatchProfile(cost_unit="tokens", hard_cap=1000, target_size=500))
    outcome = simulate(s, make_arrivals(s), [engine])
    assert max(outcome.batches.size) <= 10, "a 1000-token cap holds ten 100-token requests"
    assert not conservation_problems(outcome)


def test_overload_with_deadlines_is_shed_at_arrival_and_raises_goodput():
    s = scenario(
        deadline_ms=300.0, slo_p99_ms=200.0, priority={"mix": [1.0]}, phases=[{"duration_s": 3, "rate_per_s": 3000}]
    )
    arrivals = make_arrivals(s)
    runs = {when: simulate(s, arrivals, engines(s, slo_p99_ms=200.0, shed_when=when)) for when in ("slo", "never")}
    for out in runs.values():
        assert conservation_problems(out) == []
    shed, waited = runs["slo"], runs["never"]
    answer_ms = (shed.done_ms - arrivals.deliver_ms)[shed.expired]
    assert shed.expired.mean() > 0.2
    assert np.median(answer_ms) < 50.0, "shed when the queue says so, not at the 300 ms deadline"
    assert np.median((waited.done_ms - arrivals.deliver_ms)[waited.expired]) >= 250.0
    good, late = measure(s, shed), measure(s, waited)
    assert good.goodput_rps > 1.5 * late.goodput_rps
    assert good.good_share == pytest.approx(
        good.goodput_rps * (arrivals.create_ms.max() - arrivals.create_ms.min()) / 1000.0 / len(arrivals)
    )
