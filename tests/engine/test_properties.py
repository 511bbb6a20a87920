"""Properties over arbitrary event sequences: nothing lost or duplicated, limits hold."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.config import BatchProfile
from pipeline.core.engine import Batch, BatchingEngine, PendingRequest

offer_event = st.tuples(
    st.just("offer"),
    st.integers(min_value=1, max_value=30),  # how many
    st.integers(min_value=0, max_value=4),  # priority (beyond the levels on purpose)
    st.integers(min_value=1, max_value=90),  # cost (tokens)
    st.sampled_from([None, 3.0, 40.0]),  # deadline, relative
    st.floats(min_value=0.0, max_value=30.0),  # record time this far in the past
)
poll_event = st.tuples(st.just("poll"), st.booleans(), st.integers(min_value=0, max_value=100))
complete_event = st.tuples(st.just("complete"), st.floats(min_value=0.1, max_value=80.0))
advance_event = st.tuples(st.just("advance"), st.floats(min_value=0.0, max_value=25.0))
events = st.lists(st.one_of(offer_event, poll_event, complete_event, advance_event), max_size=60)

profiles = st.builds(
    BatchProfile,
    target_size=st.just(8),
    hard_cap=st.sampled_from([8, 12, 64]),
    max_wait_ms=st.sampled_from([0.0, 5.0, 20.0]),
    max_inflight_batches=st.integers(min_value=1, max_value=3),
    cost_unit=st.sampled_from(["requests", "tokens"]),
    adaptive_window=st.booleans(),
    adaptive_cap=st.booleans(),
    tail_min_samples=st.just(4),
    wait_sample_window=st.just(16),
    tail_mark_floor_ms=st.sampled_from([None, 0.0]),
    default_deadline_ms=st.sampled_from([None, 15.0]),
    rate_halflife_ms=st.sampled_from([2.0, 250.0]),
)


class Ledger:
    """Drives an engine and checks every decision it makes against the rules."""

    def __init__(self, engine: BatchingEngine) -> None:
        self.engine = engine
        self.profile = engine.profile
        assert isinstance(self.profile.hard_cap, int) and isinstance(self.profile.target_size, int), "drawn as numbers"
        self.hard_cap, self.target_size = self.profile.hard_cap, self.profile.target_size
        self.now = 0.0
        self.offered: set[str] = set()
        self.outcomes: dict[str, str] = {}
        self.running: list[Batch] = []
        self.next_id = 0
        self.last_batch_id = 0

    def offer(self, n: int, priority: int, cost: int, deadline: float | None, age: float) -> None:
        for _ in range(n):
            self.next_id += 1
            name = f"q{self.next_id}"
            self.offered.add(name)
            self.engine.offer(
                PendingRequest(
                    name,
                    self.now - age,
                    cost=cost,
                    priority=priority,
                    deadline_ms=None if deadline is None else self.now + deadline,
                ),
                self.now,
            )

    def poll(self, device_free: bool, backlog: int) -> float | None:
        decision = self.engine.poll(self.now, device_free=device_free, backlog=backlog)
        for request in decision.expired:
            self._outcome(request.request_id, "expired")
        batch = decision.batch
        if batch is not None:
            assert device_free
            self._check(batch, backlog)
            self.running.append(batch)
        assert self.engine.inflight == len(self.running) <= self.profile.max_inflight_batches
        assert decision.wake_at_ms is None or decision.wake_at_ms >= self.now - 1e-9 or batch
        return decision.wake_at_ms

    def _check(self, batch: Batch, backlog: int) -> None:
        record = batch.record
        assert batch.batch_id == record.batch_id == self.last_batch_id + 1
        self.last_batch_id = batch.batch_id
        assert batch.requests, "no empty batches"
        tokens = self.profile.cost_unit == "tokens"
        cost = sum(r.cost if tokens else 1 for r in batch.requests)
        assert record.cost == cost and record.size == len(batch.requests)
        assert record.effective_cap <= self.hard_cap
        assert cost <= record.effective_cap or len(batch.requests) == 1
        assert record.queue_depth == self.engine.pending + backlog
        assert record.hit_target == (cost >= self.target_size)
        assert record.marked_count == sum(r.marked for r in batch.requests)
        for request in batch.requests:
            self._outcome(request.request_id, "dispatched")
        marked = [r.marked for r in batch.requests]
        assert marked == sorted(marked, reverse=True), "marked requests lead the batch"

    def _outcome(self, name: str, outcome: str) -> None:
        assert name in self.offered, f"{name} was never offered"
        assert name not in self.outcomes, f"{name} left twice ({self.outcomes[name]}, {outcome})"
        self.outcomes[name] = outcome

    def complete(self, compute_ms: float) -> None:
        if self.running:
            batch = self.running.pop(0)
            self.now += compute_ms
            self.engine.completed(batch, self.now, compute_ms)

    def drain(self) -> None:
        """Complete everything and keep polling at the wake times until empty."""
        for _ in range(10_000):
            while self.running:
                self.complete(1.0)
            wake = self.poll(True, 0)
            if self.engine.pending == 0 and not self.running:
                return
            if not self.running:
                assert wake is not None, "pending work with a free device needs a wake time"
                assert wake <= self.now + self.profile.max_wait_ms + 1e-6
                self.now = max(self.now, wake)
        raise AssertionError("engine never drained")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles, script=events)
def test_every_request_leaves_exactly_once_and_limits_hold(profile: BatchProfile, script: list[tuple]) -> None:
    ledger = Ledger(BatchingEngine(profile))
    for event in script:
        kind = event[0]
        if kind == "offer":
            ledger.offer(*event[1:])
        elif kind == "poll":
            ledger.poll(event[1], event[2])
        elif kind == "complete":
            ledger.complete(event[1])
        else:
            ledger.now += event[1]
    ledger.drain()
    assert set(ledger.outcomes) == ledger.offered
    stats = ledger.engine.stats()
    assert stats["dispatched"] + stats["expired"] == len(ledger.offered)
    assert stats["pending"] == 0 and stats["inflight"] == 0


@settings(max_examples=80, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=30.0), min_size=1, max_size=80),
    compute=st.floats(min_value=0.5, max_value=50.0),
    slots=st.integers(min_value=1, max_value=3),
    adaptive=st.booleans(),
)
def test_no_request_waits_past_max_wait_while_a_slot_is_free(
    gaps: list[float], compute: float, slots: int, adaptive: bool
) -> None:
    """A driver that polls on every arrival, completion and wake time: any
    request that leaves with a slot free has waited at most max_wait_ms beyond
    the time a slot was busy for it."""
    profile = BatchProfile(
        max_wait_ms=20.0, max_inflight_batches=slots, adaptive_window=adaptive, rate_halflife_ms=20.0
    )
    engine = BatchingEngine(profile)
    now = 0.0
    arrivals = []
    for gap in gaps:
        now += gap
        arrivals.append(now)
    running: list[tuple[float, Batch]] = []
    wake: float | None = None
    index = 0
    clock = 0.0
    free_since = 0.0
    for _ in range(100_000):
        if not (index < len(arrivals) or engine.pending or running):
            break
        candidates = [t for t in (arrivals[index] if index < len(arrivals) else None, wake) if t is not None]
        candidates += [done for done, _ in running]
        clock = max(clock, min(candidates))
        while running and running[0][0] <= clock:
            done, batch = running.pop(0)
            engine.completed(batch, done, compute)
            free_since = max(free_since, done) if len(running) < slots else free_since
        while index < len(arrivals) and arrivals[index] <= clock:
            engine.offer(PendingRequest(f"a{index}", arrivals[index]), clock)
            index += 1
        wake = None
        while True:
            decision = engine.poll(clock)
            if decision.batch is None:
                wake = decision.wake_at_ms
                break
            record = decision.batch.record
            start = max(record.dispatch_ms - record.oldest_wait_ms, free_since)
            assert record.dispatch_ms - start <= profile.max_wait_ms + 1e-6
            running.append((clock + compute, decision.batch))
            running.sort(key=lambda item: item[0])
        if len(running) == slots:
            free_since = float("inf")
        elif free_since == float("inf"):
            free_since = clock
    else:
        raise AssertionError("driver made no progress")
