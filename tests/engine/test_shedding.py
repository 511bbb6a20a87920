"""Shedding: what cannot be served in time is answered at once, with the reason (virtual clock)."""

import pytest

from pipeline.core.config import BatchProfile, ConfigError
from pipeline.core.engine import BatchingEngine
from pipeline.core.engine.shedding import ShedRule, finish_estimate_ms
from tests.engine.helpers import request

CURVE = [(1, 10.0), (8, 40.0)]
"""t(1) = 10 ms, t(8) = 40 ms: the engine starts from this measured curve."""


def engine(**profile) -> BatchingEngine:
    base = {"target_size": 8, "hard_cap": 8, "slo_p99_ms": 100.0, "batch_overhead_ms": 0.0}
    return BatchingEngine(BatchProfile(**{**base, **profile}), prior_costs=CURVE)


def test_finish_estimate_counts_full_batches_then_the_last_partial_one() -> None:
    costs: dict[float, float] = {1: 10.0, 8: 40.0, 4: 25.0}
    t = costs.get
    assert finish_estimate_ms(90.0, 100.0, 20, 8, 1, t, 1.0) == 100.0 + 2 * 41.0 + 26.0
    assert finish_estimate_ms(90.0, 100.0, 20, 8, 3, t, 0.0) == 125.0, "three streams: one round"
    assert finish_estimate_ms(90.0, 100.0, 5, 8, 1, lambda b: None, 0.0) is None
    filled = finish_estimate_ms(90.0, 100.0, 4, 8, 1, t, 0.0, arrival_cost_per_ms=0.4)
    assert filled == 100.0 + 40.0, "4 more arrive while the device is busy: its batch is full"


def test_rule_limits() -> None:
    assert ShedRule("slo", 100.0).limit(0.0, 300.0) == (100.0, "cannot_meet_slo")
    assert ShedRule("slo", 100.0).limit(0.0, 50.0) == (50.0, "cannot_meet_deadline")
    assert ShedRule("deadline", 100.0).limit(0.0, 300.0) == (300.0, "cannot_meet_deadline")
    assert ShedRule("never", 100.0).limit(0.0, 300.0) is None
    assert ShedRule("slo", 100.0).limit(0.0, None) is None


def test_arrivals_that_cannot_meet_the_slo_are_answered_at_once() -> None:
    e = engine()
    for i in range(40):
        e.offer(request(0.0, deadline_ms=300.0, name=f"r{i}"), 0.0)
    decision = e.poll(0.0)
    assert decision.batch is not None and decision.batch.size == 8
    shed = decision.expired
    # batches of 8 take 40 ms: r0-r15 finish by 80 ms; a third batch, filled up by
    # arrivals at the rate just seen, would end at 120 ms, past the 100 ms SLO
    assert [r.request_id for r in shed] == [f"r{i}" for i in range(16, 40)]
    assert {r.expiry for r in shed} == {"cannot_meet_slo"}
    assert all(
        r.predicted_done_ms is not None and r.finish_by_ms is not None and r.predicted_done_ms > r.finish_by_ms == 100.0
        for r in shed
    )
    assert e.pending == 16 - 8
    stats = e.stats()
    assert stats["shed"] == 24 and stats["expired"] == 24


def test_shed_when_deadline_runs_what_is_late_for_the_slo_but_not_for_the_deadline() -> None:
    e = engine(shed_when="deadline")
    for i in range(80):
        e.offer(request(0.0, deadline_ms=200.0, name=f"r{i}"), 0.0)
    decision = e.poll(0.0)
    # 40 ms per batch of 8: five batches (40 requests) end by 200 ms
    assert len(decision.expired) == 80 - 40
    assert {r.expiry for r in decision.expired} == {"cannot_meet_deadline"}


def test_shed_when_never_waits_for_the_deadline() -> None:
    e = engine(shed_when="never")
    for _ in range(40):
        e.offer(request(0.0, deadline_ms=300.0), 0.0)
    first = e.poll(0.0)
    assert first.expired == [] and first.wake_at_ms == 300.0
    late = e.poll(300.0)
    assert len(late.expired) == 32 and {r.expiry for r in late.expired} == {"deadline"}


def test_requests_without_a_deadline_are_never_shed() -> None:
    e = engine()
    for _ in range(500):
        e.offer(request(0.0), 0.0)
    assert e.poll(0.0).expired == [] and e.pending == 492
    e.offer(request(0.0, deadline_ms=10_000.0, name="behind"), 0.0)
    assert [r.request_id for r in e.poll(0.0).expired] == ["behind"], "500 queued ahead: past its SLO"


def test_a_request_that_became_too_late_is_shed_at_the_head_before_its_deadline() -> None:
    e = engine(target_size=8, hard_cap=8)
    for i in range(16):
        e.offer(request(0.0, deadline_ms=300.0, name=f"r{i}"), 0.0)
    running = e.poll(0.0).batch
    assert running is not None
    # the device is far slower than the curve said: not even one more request ends by 100 ms
    e.completed(running, 95.0, 95.0)
    decision = e.poll(95.0)
    assert decision.batch is None
    assert len(decision.expired) == 8 and {r.expiry for r in decision.expired} == {"cannot_meet_slo"}
    assert e.pending == 0


def test_urgent_arrivals_push_a_waiting_request_out_of_time() -> None:
    e = engine(priority_levels=2)
    e.offer(request(0.0, name="busy"), 0.0)
    running = e.poll(0.0).batch
    assert running is not None
    e.offer(request(1.0, priority=1, deadline_ms=500.0, name="normal"), 1.0)
    for i in range(16):
        e.offer(request(2.0, priority=0, deadline_ms=500.0, name=f"u{i}"), 2.0)
    assert e.poll(2.0, device_free=False).expired == [], "two batches of 8 urgent end by 90 ms, then normal by 100"
    e.completed(running, 10.0, 10.0)
    first = e.poll(10.0).batch
    assert first is not None and first.size == 8
    e.completed(first, 60.0, 50.0)  # slower than the curve said
    second = e.poll(60.0)
    assert second.batch is not None and second.expired == []
    # the second urgent batch ends around 100 ms: normal, behind it, would end past 101 ms
    behind = e.poll(60.0, device_free=False)
    assert [(r.request_id, r.expiry) for r in behind.expired] == [("normal", "cannot_meet_slo")]


def test_a_batch_member_with_an_earlier_limit_than_its_head_is_shed_not_run() -> None:
    e = engine(priority_levels=2, slo_p99_ms=1000.0)
    e.offer(request(0.0, name="busy"), 0.0)
    running = e.poll(0.0).batch
    assert running is not None
    e.offer(request(0.0, priority=1, deadline_ms=40.0, name="tight"), 0.0)
    e.offer(request(5.0, priority=0, deadline_ms=900.0, name="urgent"), 5.0)
    e.completed(running, 10.0, 10.0)
    decision = e.poll(30.0)  # urgent first: the batch of two would end at ~44 ms, past 40
    assert decision.batch is not None
    assert [r.request_id for r in decision.batch.requests] == ["urgent"]
    assert [(r.request_id, r.expiry) for r in decision.expired] == [("tight", "cannot_meet_deadline")]


def test_unknown_shed_when_is_refused() -> None:
    with pytest.raises(ConfigError, match="shed_when"):
        BatchProfile(shed_when="sometimes")  # type: ignore[arg-type]


def test_overruns_stretch_the_estimate_only_where_batch_times_vary() -> None:
    from pipeline.core.engine.shedding import Overruns

    steady, varied = Overruns(), Overruns()
    for i in range(64):
        steady.observe(40.0, 40.0)
        varied.observe(40.0 * (1.5 if i % 4 == 0 else 0.9), 40.0)
    assert steady.margin == 1.0
    assert varied.margin == pytest.approx(1.5)
    costs: dict[float, float] = {8: 40.0}
    assert finish_estimate_ms(0.0, 0.0, 8, 8, 1, costs.get, 0.0, margin=1.5) == 60.0
