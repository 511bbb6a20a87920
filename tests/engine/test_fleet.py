"""Group-relative forwarding (pipeline.core.engine.peer_forwarding): who gets the back of a queue, and when nobody does."""

from __future__ import annotations

from pipeline.core.engine.peer_forwarding import (
    Forward,
    ForwardRule,
    LocalView,
    MemberView,
    local_finish_ms,
    peer_finish_ms,
    peers_after,
    plan_forwards,
    start_in_ms,
)


def affine(a: float, c: float):
    return lambda b: a + c * b


FAST = affine(20.0, 2.0)
SLOW = affine(60.0, 6.0)


def peer(
    name: str, t=FAST, *, start_in: float = 0.0, capacity: float = 460.0, at: float = 0.0, parts=(0, 1)
) -> MemberView:
    return MemberView(name, at, start_in, t(4), capacity, tuple(parts))


def test_a_slow_consumer_hands_the_back_of_its_queue_to_a_fast_idle_peer_and_keeps_the_front() -> None:
    local = LocalView(busy_for_ms=0.0, cap=85, t_ms=SLOW, load=1.0)
    rule = ForwardRule(hop_ms=5.0)
    fast = peer("fast")  # an older consumer's beacon: no load, so no relief, the full margin
    plan = plan_forwards(10, [True] * 10, local, [fast], 0.0, rule)
    kept = 10 - len(plan)
    assert [f.index for f in plan] == list(range(9, kept - 1, -1)), "from the back, without gaps"
    assert 1 <= kept <= 4
    # the first kept request finishes here within twice what the peer would now need for it
    assert local_finish_ms(kept - 1, kept, local) < 2 * peer_finish_ms(fast, len(plan), rule)
    relieving = MemberView("fast", 0.0, 0.0, FAST(4), 460.0, (0, 1), load=0.3)
    assert len(plan_forwards(10, [True] * 10, local, [relieving], 0.0, rule)) > len(plan), (
        "a clearly less loaded peer takes more"
    )
    assert {f.member_id for f in plan} == {"fast"}
    assert sorted({f.partition for f in plan}) == [0, 1], "spread over the peer's priority partitions"


def test_a_fast_consumer_forwards_nothing_to_a_slow_peer() -> None:
    local = LocalView(busy_for_ms=0.0, cap=16, t_ms=FAST)
    assert plan_forwards(10, [True] * 10, local, [peer("slow", SLOW, capacity=150.0)], 0.0, ForwardRule()) == []


def test_equal_consumers_keep_their_work_through_noise_but_a_deep_backlog_moves() -> None:
    busy = LocalView(busy_for_ms=28.0, cap=32, t_ms=FAST)
    same = peer("twin", start_in=28.0)
    assert plan_forwards(8, [True] * 8, busy, [same], 0.0, ForwardRule()) == [], "a twin in the same state gets nothing"
    assert plan_forwards(4, [True] * 4, busy, [peer("idle-twin")], 0.0, ForwardRule()) == [], "a few ms: noise"
    drowning = plan_forwards(200, [True] * 200, busy, [same], 0.0, ForwardRule())
    assert drowning and drowning[0].index == 199
    assert len(drowning) < 200, "the front of the queue stays"


def test_each_forward_adds_its_load_to_the_peer_so_one_scan_cannot_flood_it() -> None:
    local = LocalView(busy_for_ms=0.0, cap=100, t_ms=affine(200.0, 10.0))
    small = peer("small", capacity=50.0)
    sent: dict[str, int] = {}
    rule = ForwardRule()
    plan = plan_forwards(500, [True] * 500, local, [small], 0.0, rule, sent)
    assert 0 < len(plan) < 250, "each forward adds 20 ms to the peer's start"
    assert sent == {"small": len(plan)}
    last = plan[-1].index
    here = local_finish_ms(last, last + 1, local)
    margin = max(rule.min_gain_ms, rule.gain_share * local.t_ms(1))
    assert peer_finish_ms(small, len(plan) - 1, rule) <= here - margin, "each forward paid"
    left = 500 - len(plan)
    later = plan_forwards(left, [True] * left, local, [small], 1500.0, ForwardRule(), dict(sent))
    again = plan_forwards(left, [True] * left, local, [small], 0.0, ForwardRule(), sent)
    assert len(again) < len(plan), "the peer's queue, as far as this consumer knows, is still there"
    assert later == again, "and stays there until its next beacon, however long that takes"


def test_stale_or_partitionless_peers_get_no_work_and_unmeasured_ones_one_request_per_beacon() -> None:
    local = LocalView(busy_for_ms=0.0, cap=85, t_ms=SLOW)
    rule = ForwardRule(stale_ms=1000.0)
    for useless in (peer("gone", at=-5000.0), peer("no-parts", parts=())):
        assert plan_forwards(10, [True] * 10, local, [useless], 0.0, rule) == []
    new = MemberView("new", 0.0, 0.0, 0.0, 0.0, (3,))
    drowning = LocalView(busy_for_ms=500.0, cap=8, t_ms=SLOW)
    sent: dict[str, int] = {}
    assert plan_forwards(100, [True] * 100, drowning, [new], 0.0, rule, sent) == [Forward(99, "new", 3)]
    assert plan_forwards(99, [True] * 99, drowning, [new], 0.0, rule, sent) == [], "one until its next beacon"


def test_forwards_are_never_forwarded_again_and_a_busy_peer_stays_busy_until_it_says_otherwise() -> None:
    local = LocalView(busy_for_ms=0.0, cap=85, t_ms=SLOW)
    movable = [i % 2 == 0 for i in range(10)]
    plan = plan_forwards(10, movable, local, [peer("fast")], 0.0, ForwardRule())
    assert plan and all(movable[f.index] for f in plan)
    busy_then = peer("fast", start_in=400.0, at=0.0)
    assert plan_forwards(10, [True] * 10, local, [busy_then], 0.0, ForwardRule()) == []
    assert plan_forwards(10, [True] * 10, local, [busy_then], 400.0, ForwardRule()) == [], (
        "a queue ahead is not aged away"
    )


def test_the_beacon_start_time_is_the_full_batches_ahead() -> None:
    local = LocalView(busy_for_ms=15.0, cap=10, t_ms=FAST)
    assert start_in_ms(0, local) == 15.0
    assert start_in_ms(9, local) == 15.0
    assert start_in_ms(25, local) == 15.0 + 2 * FAST(10)


def test_ties_go_to_the_peer_after_the_forwarder_so_forwarders_spread() -> None:
    views = [peer(name) for name in ("c1", "c2", "c3", "c4")]
    assert [p.member_id for p in peers_after("c2", views)] == ["c3", "c4", "c1"]
    local = LocalView(busy_for_ms=0.0, cap=85, t_ms=SLOW)
    first = plan_forwards(10, [True] * 10, local, peers_after("c2", views), 0.0, ForwardRule())
    assert first[0].member_id == "c3"
    assert {f.member_id for f in first} == {"c3", "c4", "c1"}, "each forward raises a peer's start: the next peer"


def test_a_clearly_less_loaded_peer_relieves_a_hot_consumer_but_a_twin_at_the_same_load_does_not() -> None:
    # a hot consumer on an equal device, mid-batch: the requests it keeps now will have company by dispatch
    hot = LocalView(busy_for_ms=40.0, cap=128, t_ms=FAST, served_per_ms=0.4, load=1.2)
    cool = MemberView("cool", 0.0, 20.0, FAST(10), 460.0, (0,), load=0.4)
    twin = MemberView("twin", 0.0, 20.0, FAST(10), 460.0, (0,), load=1.1)
    relieved = plan_forwards(12, [True] * 12, hot, [cool], 0.0, ForwardRule())
    kept_for_twin = 12 - len(plan_forwards(12, [True] * 12, hot, [twin], 0.0, ForwardRule()))
    assert relieved, "the cooler peer takes the back of the queue"
    assert 12 - len(relieved) < kept_for_twin, "a twin at the same load keeps the full margin: less moves"
    # the kept request's prediction counts the 16 requests that join its batch before the device frees
    assert local_finish_ms(0, 1, hot, joining=True) == 40.0 + FAST(17)
    assert local_finish_ms(0, 1, hot) == 40.0 + FAST(1)


def test_load_in_the_view_is_offered_rate_over_capacity() -> None:
    from pipeline.core.engine.peer_forwarding import Flow, beacon_view, curve_view

    class Curve:
        cap = 10

        def estimate_ms(self, size: int) -> float:
            return 20.0 + 2.0 * size  # 10 per 40 ms: 250 per second

    flow = Flow(halflife_ms=1000.0)
    for k in range(4000):  # 100 per second offered for 40 s, every second one served
        flow.offered(k * 10.0, 1)
        if k % 2:
            flow.served(k * 10.0, 1)
    offered, served = flow.rates_per_ms(40000.0)
    view = curve_view(Curve(), 0.0, offered, served)  # type: ignore[arg-type]
    assert view is not None
    assert abs(view.load - 0.4) < 0.03 and abs(view.served_per_ms - 0.05) < 0.005
    assert beacon_view("me", 0.0, 0, view, 0.0, (0,)).load == view.load


def test_a_running_batch_ages_with_the_beacon_down_to_half_a_batch_but_a_queue_does_not() -> None:
    rule = ForwardRule(hop_ms=10.0)
    mid_batch = MemberView("p", 0.0, 40.0, 40.0, 460.0, (0,))
    assert peer_finish_ms(mid_batch, 0, rule, age_ms=10.0) == 10.0 + 30.0 + 40.0
    assert peer_finish_ms(mid_batch, 0, rule, age_ms=90.0) == 10.0 + 20.0 + 40.0, "phase unknown: half a batch"
    nearly_free = MemberView("p", 0.0, 5.0, 40.0, 460.0, (0,))
    assert peer_finish_ms(nearly_free, 0, rule, age_ms=90.0) == 10.0 + 5.0 + 40.0, "never later than it said"
    queued = MemberView("p", 0.0, 300.0, 40.0, 460.0, (0,))
    assert peer_finish_ms(queued, 0, rule, age_ms=200.0) == 10.0 + 300.0 + 40.0


def test_a_beacon_says_the_batch_its_waiting_queue_makes_not_only_its_recent_one() -> None:
    from pipeline.core.engine.peer_forwarding import beacon_view

    view = LocalView(busy_for_ms=10.0, cap=128, t_ms=FAST)
    assert beacon_view("b", 0.0, 3, view, 40.0, (0,)).batch_ms == 40.0, "a short queue: the recent batch time"
    filling = beacon_view("b", 0.0, 100, view, 40.0, (0,))
    assert filling.start_in_ms == 10.0 and filling.batch_ms == FAST(101), "100 waiting: the batch they make"
