"""Share mode's pull rule for a slow member (pipeline.core.engine.share_pull), on virtual inputs."""

from __future__ import annotations

import random

from pipeline.core.engine.peer_forwarding import MemberView
from pipeline.core.engine.share_pull import Pull, PullRule, pull_bound


def affine(a: float, c: float):
    return lambda b: a + c * b


FAST = affine(20.0, 2.0)
SLOW = affine(60.0, 6.0)
FAST_CAPACITY, SLOW_CAPACITY = 460.0, 153.0


def beacon(start_in: float, batch_ms: float, *, at: float = 0.0, capacity: float = FAST_CAPACITY) -> MemberView:
    return MemberView("fast", at, start_in, batch_ms, capacity, ())


def test_a_member_as_fast_as_its_peers_pulls_a_full_batch() -> None:
    twin = beacon(0.0, 28.0, capacity=400.0)  # twins' learned capacities differ by noise
    assert pull_bound(FAST, 330.0, 64, [twin], 0.0, PullRule()) == Pull(64, restrained=False)
    assert pull_bound(SLOW, SLOW_CAPACITY, 64, [twin], 0.0, PullRule()).restrained, "a 3x slower one is not a twin"


def test_a_slow_member_leaves_a_record_to_an_idle_fast_peer() -> None:
    assert pull_bound(SLOW, SLOW_CAPACITY, 64, [beacon(0.0, 28.0)], 0.0, PullRule()) == Pull(0, restrained=True)


def test_a_slow_member_takes_the_batch_it_finishes_before_a_busy_peer_would() -> None:
    busy = beacon(50.0, 50.0)  # mid-batch for 50 ms more, then a 50 ms batch: 100 ms for a record left now
    bound = pull_bound(SLOW, SLOW_CAPACITY, 64, [busy], 0.0, PullRule())
    assert bound == Pull(6, restrained=True)
    assert SLOW(bound.units) <= 100.0 < SLOW(bound.units + 1)


def test_a_beacons_start_time_ages_to_half_a_batch() -> None:
    rule = PullRule()
    # 40 ms later the peer is 40 ms further into its batch: 10 ms left, but the phase is unknown
    # past the beacon, so no less than half a batch (25 ms) is counted: 75 ms for the record
    assert pull_bound(SLOW, SLOW_CAPACITY, 64, [beacon(50.0, 50.0)], 40.0, rule).units == 2
    assert pull_bound(SLOW, SLOW_CAPACITY, 64, [beacon(50.0, 50.0)], 400.0, rule).units == 2


def test_the_soonest_peer_decides() -> None:
    peers = [beacon(200.0, 50.0), beacon(0.0, 30.0)]
    assert pull_bound(SLOW, SLOW_CAPACITY, 64, peers, 0.0, PullRule()).units == 0


def test_nobody_known_faster_means_the_pull_is_unbounded() -> None:
    rule = PullRule(stale_ms=2000.0)
    assert pull_bound(None, 0.0, 64, [beacon(0.0, 28.0)], 0.0, rule) == Pull(64, False), "measured nothing itself"
    assert pull_bound(SLOW, SLOW_CAPACITY, 64, [], 0.0, rule) == Pull(64, False), "alone"
    assert pull_bound(SLOW, SLOW_CAPACITY, 64, [beacon(0.0, 28.0)], 2500.0, rule) == Pull(64, False), "peer gone"
    unmeasured = beacon(0.0, 0.0, capacity=0.0)
    assert pull_bound(SLOW, SLOW_CAPACITY, 64, [unmeasured], 0.0, rule) == Pull(64, False), "peer just joined"


def test_the_bound_is_the_largest_batch_that_finishes_in_time() -> None:
    rng = random.Random(7)
    for _ in range(500):
        a, c = rng.uniform(5, 100), rng.uniform(0.1, 10)
        t = affine(a, c)
        peer = beacon(rng.uniform(0, 300), rng.uniform(5, 200), at=0.0)
        wait = peer.start_in_ms + peer.batch_ms
        units = pull_bound(t, 1.0, 128, [peer], 0.0, PullRule()).units
        assert 0 <= units <= 128
        assert units == 0 or t(units) <= wait
        assert units == 128 or t(units + 1) > wait


def simulate(devices: list, rate_per_ms: float, seconds: float, *, rule: PullRule | None, seed: int = 1) -> float:
    """p99 (ms) of a share group: Poisson arrivals on the broker, devices that pull when free (every
    ms), each bounded by `pull_bound` against fresh beacons of the others (`rule` None: pull-by-rate)."""
    rng = random.Random(seed)
    queue: list[float] = []
    latencies: list[float] = []
    busy_until = [0.0] * len(devices)
    running: list[list[float]] = [[] for _ in devices]
    batch_ms = [t(1) for t, _ in devices]
    next_arrival = rng.expovariate(rate_per_ms)
    for now in range(int(seconds * 1000)):
        while next_arrival <= now:
            queue.append(next_arrival)
            next_arrival += rng.expovariate(rate_per_ms)
        for i, (t, capacity) in enumerate(devices):
            if busy_until[i] > now:
                continue
            latencies.extend(busy_until[i] - arrived for arrived in running[i])
            running[i] = []
            if not queue:
                continue
            units = 64
            if rule is not None:
                peers = [
                    MemberView(str(j), now, max(0.0, busy_until[j] - now), batch_ms[j], devices[j][1], ())
                    for j in range(len(devices))
                    if j != i
                ]
                units = pull_bound(t, capacity, 64, peers, now, rule).units
            if units == 0:
                continue
            running[i], queue[:] = queue[:units], queue[units:]
            took = t(len(running[i]))
            busy_until[i] = now + took
            batch_ms[i] = 0.8 * batch_ms[i] + 0.2 * took
    latencies.sort()
    return latencies[int(0.99 * len(latencies))]


def test_in_a_virtual_group_the_rule_keeps_a_slow_member_off_the_tail() -> None:
    """Two devices at 300 req/s (t(b) = 20 + 2b ms, one 3x slower): pulling by rate puts the slow
    device's batches in the group's p99; the rule brings it near the perfect split's."""
    fast, slow = (FAST, FAST_CAPACITY), (SLOW, SLOW_CAPACITY)
    all_fast = simulate([fast, fast], 0.3, 30.0, rule=None)
    by_rate = simulate([slow, fast], 0.3, 30.0, rule=None)
    ruled = simulate([slow, fast], 0.3, 30.0, rule=PullRule())
    assert by_rate > 2.0 * all_fast
    assert ruled < 0.75 * by_rate
    assert ruled <= 2.0 * all_fast
    assert simulate([fast, fast], 0.3, 30.0, rule=PullRule()) == all_fast, "twins are never restrained"
