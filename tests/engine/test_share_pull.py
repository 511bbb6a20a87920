"""Share mode's pull rule for a slow member (pipeline.core.engine.share_pull), on virtual inputs."""

from __future__ import annotations

import random

from pipeline.core.engine.costcurve import CostCurve
from pipeline.core.engine.peer_forwarding import MemberView, capacity_per_s, curve_view
from pipeline.core.engine.share_pull import Pull, PullRule, outpaces_a_peer, pull_bound


def affine(a: float, c: float):
    return lambda b: a + c * b


FAST = affine(20.0, 2.0)
SLOW = affine(60.0, 6.0)
FAST_CAPACITY, SLOW_CAPACITY = 460.0, 153.0


def beacon(
    start_in: float,
    batch_ms: float,
    *,
    at: float = 0.0,
    capacity: float = FAST_CAPACITY,
    batches: int | None = 100,
    unit_ms: float | None = FAST(1),
) -> MemberView:
    return MemberView("fast", at, start_in, batch_ms, capacity, (), batches=batches, unit_ms=unit_ms)


def bound(t, capacity, peers, now=0.0, rule=None, *, batches=100, measured_at=None, ceiling=64) -> Pull:
    """`pull_bound` for a member with plenty of batches measured, the newest just now."""
    at = now if measured_at is None else measured_at
    return pull_bound(t, capacity, ceiling, peers, now, rule or PullRule(), batches=batches, measured_at_ms=at)


def test_a_member_as_fast_as_its_peers_pulls_a_full_batch() -> None:
    twin = beacon(0.0, 28.0, capacity=400.0)  # twins' learned capacities differ by noise
    assert bound(FAST, 330.0, [twin], 0.0, PullRule()) == Pull(64, restrained=False)
    assert bound(SLOW, SLOW_CAPACITY, [twin], 0.0, PullRule()).restrained, "a 3x slower one is not a twin"


def test_a_slow_member_leaves_a_record_to_an_idle_fast_peer() -> None:
    assert bound(SLOW, SLOW_CAPACITY, [beacon(0.0, 28.0)], 0.0, PullRule()) == Pull(0, restrained=True)


def test_a_slow_member_takes_the_batch_it_finishes_before_a_busy_peer_would() -> None:
    busy = beacon(50.0, 50.0)  # mid-batch for 50 ms more, then a 50 ms batch: 100 ms for a record left now
    pull = bound(SLOW, SLOW_CAPACITY, [busy], 0.0, PullRule())
    assert pull == Pull(6, restrained=True)
    assert SLOW(pull.units) <= 100.0 < SLOW(pull.units + 1)


def test_a_beacons_start_time_ages_to_half_a_batch() -> None:
    rule = PullRule()
    # 40 ms later the peer is 40 ms further into its batch: 10 ms left, but the phase is unknown
    # past the beacon, so no less than half a batch (25 ms) is counted: 75 ms for the record
    assert bound(SLOW, SLOW_CAPACITY, [beacon(50.0, 50.0)], 40.0, rule).units == 2
    assert bound(SLOW, SLOW_CAPACITY, [beacon(50.0, 50.0)], 400.0, rule).units == 2


def test_the_soonest_peer_decides() -> None:
    peers = [beacon(200.0, 50.0), beacon(0.0, 30.0)]
    assert bound(SLOW, SLOW_CAPACITY, peers, 0.0, PullRule()).units == 0


def test_nobody_known_faster_means_the_pull_is_unbounded() -> None:
    rule = PullRule(stale_ms=2000.0)
    assert bound(None, 0.0, [beacon(0.0, 28.0)], 0.0, rule) == Pull(64, False), "measured nothing itself"
    assert bound(SLOW, SLOW_CAPACITY, [], 0.0, rule) == Pull(64, False), "alone"
    assert bound(SLOW, SLOW_CAPACITY, [beacon(0.0, 28.0)], 2500.0, rule) == Pull(64, False), "peer gone"
    unmeasured = beacon(0.0, 0.0, capacity=0.0)
    assert bound(SLOW, SLOW_CAPACITY, [unmeasured], 0.0, rule) == Pull(64, False), "peer just joined"


def test_the_bound_is_the_largest_batch_that_finishes_in_time() -> None:
    rng = random.Random(7)
    for _ in range(500):
        a, c = rng.uniform(5, 100), rng.uniform(0.1, 10)
        t = affine(a, c)
        peer = beacon(rng.uniform(0, 300), rng.uniform(5, 200), at=0.0, unit_ms=1.0)
        wait = peer.start_in_ms + peer.batch_ms
        units = bound(t, 1.0, [peer], 0.0, PullRule(), ceiling=128).units
        assert 0 <= units <= 128
        assert units == 0 or t(units) <= wait
        assert units == 128 or t(units + 1) > wait


def simulate(
    devices: list, rate_per_ms: float, seconds: float, *, rule: PullRule | None, seed: int = 1, drains: bool = True
) -> float:
    """p99 (ms) of a share group: Poisson arrivals on the broker, devices that pull when free (every
    ms), each bounded by `pull_bound` (`rule` None: pull-by-rate) against the others' beacons as the
    consumers send them: every 100 ms and, with `drains`, at once when a pull leaves the broker
    empty; each arrives 8 ms after it was sent."""
    rng = random.Random(seed)
    queue: list[float] = []
    latencies: list[float] = []
    busy_until = [0.0] * len(devices)
    running: list[list[float]] = [[] for _ in devices]
    batch_ms = [t(1) for t, _ in devices]
    drained_at: list[float | None] = [None] * len(devices)
    heard: dict[int, MemberView] = {}
    in_flight: list[tuple[float, int, MemberView]] = []
    phase = [rng.uniform(0, 100) for _ in devices]
    next_arrival = rng.expovariate(rate_per_ms)

    def send(j: int, now: float) -> None:
        start = max(0.0, busy_until[j] - now)
        view = MemberView(
            str(j),
            now,
            start,
            batch_ms[j],
            devices[j][1],
            (),
            batches=100,
            unit_ms=devices[j][0](1),
            drained_at_ms=drained_at[j],
        )
        in_flight.append((now + 8.0, j, view))

    for now in range(int(seconds * 1000)):
        while next_arrival <= now:
            queue.append(next_arrival)
            next_arrival += rng.expovariate(rate_per_ms)
        for j in range(len(devices)):
            if (now - phase[j]) % 100 < 1:
                send(j, now)
        heard.update({j: view for due, j, view in in_flight if due <= now})
        in_flight = [beacon for beacon in in_flight if beacon[0] > now]
        for i, (t, capacity) in enumerate(devices):
            if busy_until[i] > now:
                continue
            latencies.extend(busy_until[i] - arrived for arrived in running[i])
            running[i] = []
            if not queue:
                continue
            units = 64
            if rule is not None:
                peers = [view for j, view in heard.items() if j != i]
                units = bound(t, capacity, peers, now, rule).units
            if units == 0:
                continue
            running[i], queue[:] = queue[:units], queue[units:]
            if len(running[i]) < units and drains:
                drained_at[i] = now
                send(i, now)
            took = t(len(running[i]))
            busy_until[i] = now + took
            batch_ms[i] = 0.8 * batch_ms[i] + 0.2 * took
    latencies.sort()
    return latencies[int(0.99 * len(latencies))]


def test_in_a_virtual_group_the_rule_keeps_a_slow_member_off_the_tail() -> None:
    """Two devices at 300 req/s (t(b) = 20 + 2b ms, one 3x slower): pulling by rate puts the slow
    device's batches in the group's p99; the rule brings it nearer the perfect split's, and more so
    when the beacons say when the broker was last left empty (the age rule) than with the peers'
    start times alone, which are up to a beacon interval old."""
    fast, slow = (FAST, FAST_CAPACITY), (SLOW, SLOW_CAPACITY)
    all_fast = simulate([fast, fast], 0.3, 30.0, rule=None)
    by_rate = simulate([slow, fast], 0.3, 30.0, rule=None)
    by_start = simulate([slow, fast], 0.3, 30.0, rule=PullRule(), drains=False)
    by_age = simulate([slow, fast], 0.3, 30.0, rule=PullRule())
    assert by_rate > 2.0 * all_fast
    assert by_start < 0.75 * by_rate
    assert by_age < 0.95 * by_start
    assert by_age <= 1.8 * all_fast
    assert simulate([fast, fast], 0.3, 30.0, rule=PullRule()) == all_fast, "twins are never restrained"


def test_two_peer_batches_is_near_the_budget_that_keeps_the_group_tail_lowest() -> None:
    """The budget against the slow member's own and the fast member's tail: with less than two of
    the fast peer's batch times it takes too little, and the fast member, carrying nearly all the
    load, sets a higher p99; with more it takes records it answers later than the fast member would,
    and its own tail sets the group's. Around two the two tails cross (the slow member's just below
    the fast one's), so taking more to even them out gains nothing."""
    fast, slow = (FAST, FAST_CAPACITY), (SLOW, SLOW_CAPACITY)
    for seed in (1, 2):
        p99 = {
            batches: simulate([slow, fast], 0.3, 20.0, rule=PullRule(tail_batches=batches), seed=seed)
            for batches in (1.5, 2.0, 3.0)
        }
        assert p99[2.0] < 0.95 * p99[1.5], (seed, p99)
        assert p99[2.0] < 0.95 * p99[3.0], (seed, p99)


def test_a_slow_member_takes_only_what_it_answers_within_two_peer_batches_of_arrival() -> None:
    """The peer left the broker empty 10 ms ago, so nothing there is older; its batches take 44 ms,
    so its latest record waits about 88 ms: the slow member takes the n with 10 + t(n) <= 88."""
    drained = MemberView("fast", 0.0, 30.0, 44.0, FAST_CAPACITY, (), batches=100, unit_ms=22.0, drained_at_ms=-10.0)
    assert bound(SLOW, SLOW_CAPACITY, [drained], 0.0) == Pull(3, restrained=True)
    assert 10 + SLOW(3) <= 88 < 10 + SLOW(4)
    recent = MemberView("fast", 0.0, 30.0, 44.0, FAST_CAPACITY, (), batches=100, unit_ms=22.0, drained_at_ms=-30.0)
    assert bound(SLOW, SLOW_CAPACITY, [recent], 0.0).units == 0, "what waits is too old for a slow batch"
    assert bound(SLOW, SLOW_CAPACITY, [recent, drained], 0.0).units == 3, "the newest drain of any peer counts"


def test_a_peer_behind_its_load_falls_back_to_its_finish_time() -> None:
    """A peer that has not left the broker empty for longer than two of its batches has a backlog:
    its next pull will not reach what waits, so the slow member helps by the finish time."""
    behind = MemberView("fast", 0.0, 100.0, 100.0, FAST_CAPACITY, (), batches=100, unit_ms=22.0, drained_at_ms=-500.0)
    assert (
        bound(SLOW, SLOW_CAPACITY, [behind], 0.0).units == bound(SLOW, SLOW_CAPACITY, [beacon(100.0, 100.0)], 0.0).units
    )
    assert bound(SLOW, SLOW_CAPACITY, [behind], 0.0).units == 23


def test_restraint_waits_for_enough_batches_on_both_sides() -> None:
    """A t(b) from a few batches is no evidence: a member misread as slow after a cold start is not
    held back, nor is one compared with a peer that has measured too little."""
    rule = PullRule(min_batches=8)
    idle = beacon(0.0, 28.0)
    assert bound(SLOW, SLOW_CAPACITY, [idle], 0.0, rule, batches=7) == Pull(64, False), "too few batches here"
    assert bound(SLOW, SLOW_CAPACITY, [beacon(0.0, 28.0, batches=7)], 0.0, rule) == Pull(64, False), "too few there"
    assert bound(SLOW, SLOW_CAPACITY, [beacon(0.0, 28.0, batches=None)], 0.0, rule) == Pull(64, False), "unsaid"
    assert bound(SLOW, SLOW_CAPACITY, [idle], 0.0, rule, batches=8) == Pull(0, True), "evidence both sides"


def test_a_restrained_member_takes_one_unit_once_its_measure_is_old() -> None:
    rule = PullRule(remeasure_ms=1000.0)
    idle = beacon(0.0, 28.0, at=5000.0)
    assert bound(SLOW, SLOW_CAPACITY, [idle], 5000.0, rule, measured_at=4500.0) == Pull(0, True)
    assert bound(SLOW, SLOW_CAPACITY, [idle], 5000.0, rule, measured_at=4000.0) == Pull(1, True)
    busy = beacon(50.0, 50.0, at=5000.0)
    assert bound(SLOW, SLOW_CAPACITY, [busy], 5000.0, rule, measured_at=0.0) == Pull(6, True), "the wait decides"


def learned_group(slowdowns: list, rate_per_ms: float, seconds: float, rule: PullRule, seed: int = 3) -> list[int]:
    """Records each member of a share group ran: devices of the same true t(b) = FAST, each learning
    its own t(b) from its jittered batch times in a `CostCurve` as the consumer's engine does (its
    capacity and beacon from it, as `consumers.forwarding` makes them); `slowdowns[i](k)` multiplies
    member i's k-th batch (a hiccup)."""
    rng = random.Random(seed)
    curves = [CostCurve(64, 0.02, None, overhead_ms=1.0) for _ in slowdowns]
    queue: list[float] = []
    busy_until = [0.0] * len(slowdowns)
    batch_ms = [0.0] * len(slowdowns)
    ran = [0] * len(slowdowns)
    batches = [0] * len(slowdowns)
    measured_at: list[float | None] = [None] * len(slowdowns)
    next_arrival = rng.expovariate(rate_per_ms)

    def view(i: int, now: float):
        local = curve_view(curves[i], max(0.0, busy_until[i] - now))
        return local, (0.0 if local is None else capacity_per_s(local))

    for now in range(int(seconds * 1000)):
        while next_arrival <= now:
            queue.append(next_arrival)
            next_arrival += rng.expovariate(rate_per_ms)
        for i, slowdown in enumerate(slowdowns):
            if busy_until[i] > now or not queue:
                continue
            local, capacity = view(i, now)
            peers = []
            for j in range(len(slowdowns)):
                if j != i:
                    peer, peer_capacity = view(j, now)
                    peer_batch = batch_ms[j] or (peer.t_ms(1) if peer else 0.0)
                    start = max(0.0, busy_until[j] - now)
                    unit = None if peer is None else peer.t_ms(1)
                    peers.append(
                        MemberView(str(j), now, start, peer_batch, peer_capacity, (), batches=batches[j], unit_ms=unit)
                    )
            t = None if local is None else local.t_ms
            units = pull_bound(t, capacity, 64, peers, now, rule, batches=batches[i], measured_at_ms=measured_at[i])
            if units.units == 0:
                continue
            size = min(units.units, len(queue))
            del queue[:size]
            took = FAST(size) * slowdown(batches[i]) * rng.lognormvariate(0.0, 0.1)
            curves[i].observe(size, took)
            busy_until[i] = now + took
            batch_ms[i] = took if not batch_ms[i] else 0.8 * batch_ms[i] + 0.2 * took
            ran[i] += size
            batches[i] += 1
            measured_at[i] = now + took
    return ran


def test_a_twin_misread_as_slow_is_not_starved() -> None:
    """Two equal devices at a load one carries alone (50 req/s); the first's opening batches run 2.5x
    slower (a hiccup under CPU contention), so its learned capacity reads well under 0.6 of its
    twin's. Restrained on that alone, it is never measured again (its idle twin always finishes a
    record sooner than its stale t(1)) and runs next to nothing. A hiccup shorter than
    `min_batches` restrains nobody; a longer one is measured away by the unit a second."""
    unguarded = PullRule(min_batches=0, remeasure_ms=float("inf"))
    short = [lambda k: 2.5 if k < 6 else 1.0, lambda k: 1.0]
    starved = learned_group(short, 0.05, 10.0, unguarded)
    assert starved[0] < 0.01 * sum(starved)
    shared = learned_group(short, 0.05, 10.0, PullRule())
    assert shared[0] > 0.4 * sum(shared)
    long = [lambda k: 2.5 if k < 20 else 1.0, lambda k: 1.0]
    starved = learned_group(long, 0.05, 30.0, unguarded)
    assert starved[0] < 0.01 * sum(starved)
    recovered = learned_group(long, 0.05, 30.0, PullRule())
    assert recovered[0] > 0.1 * sum(recovered)


def test_twins_with_noisy_measures_each_carry_a_fair_share() -> None:
    """Jittered batch times and a brief hiccup on each side in turn: neither twin ends up restrained."""
    ran = learned_group([lambda k: 1.6 if 3 <= k < 6 else 1.0, lambda k: 1.6 if k < 3 else 1.0], 0.1, 20.0, PullRule())
    assert min(ran) > 0.3 * sum(ran)


def test_only_a_member_that_outpaces_a_peer_tells_its_drains_at_once() -> None:
    rule = PullRule()
    slow_peer = MemberView("slow", 0.0, 0.0, 70.0, SLOW_CAPACITY, (), batches=100, unit_ms=SLOW(1))
    twin = MemberView("twin", 0.0, 0.0, 28.0, 400.0, (), batches=100, unit_ms=FAST(1))
    assert outpaces_a_peer(FAST_CAPACITY, FAST(1), 100, [twin, slow_peer], 0.0, rule)
    assert not outpaces_a_peer(FAST_CAPACITY, FAST(1), 100, [twin], 0.0, rule), "twins: no beacon storm"
    assert not outpaces_a_peer(FAST_CAPACITY, FAST(1), 100, [slow_peer], 2500.0, rule), "the slow peer is gone"
    assert not outpaces_a_peer(FAST_CAPACITY, FAST(1), 3, [slow_peer], 0.0, rule), "too little measured here"
    assert not outpaces_a_peer(SLOW_CAPACITY, SLOW(1), 100, [twin], 0.0, rule)


def test_a_lightly_loaded_twin_is_not_restrained_by_a_capacity_read_off_its_small_batches() -> None:
    """Eight equal devices at a few records a batch: one that has run batches of up to 3 reads its
    capacity off t(3) (the curve grows in proportion past it), a twin that once ran 12 off t(12),
    nearly three times as much. Their t(1) agree, so neither restrains the other; the capacity
    alone (a peer with no t(1) to compare) would have held the first back."""
    light = affine(40.0, 4.0)
    small_capacity = 3 * 1000.0 / light(3)
    busier_twin = beacon(0.0, light(2), capacity=12 * 1000.0 / light(12), unit_ms=light(1))
    assert small_capacity <= 0.6 * busier_twin.capacity_per_s
    assert bound(light, small_capacity, [busier_twin]) == Pull(64, restrained=False)
    assert bound(SLOW, SLOW_CAPACITY, [beacon(0.0, 28.0)]).restrained, "a 3x slower device is slower at t(1) too"
    assert bound(light, small_capacity, [beacon(0.0, 28.0, unit_ms=None)]) == Pull(64, restrained=False), "unsaid"
