"""The consumer loop's decisions, driven by a fake clock and no broker.

Each test runs the code the live loop runs (admission, `poll_engine`, the
alarm, `Outcomes`, `PeerForwarding`, `commit_points`, `Membership`'s revoke,
`StopBudget`), with records built in memory and time moved by the test, in
the way TF Serving's batching tests drive their scheduler with a fake clock.
The Kafka side of the same paths is covered by the other tests here, against
a real broker.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from aiokafka import ConsumerRecord, TopicPartition

from consumers.admit import Admission
from consumers.answers import Answers
from consumers.clock import Alarm
from consumers.decide import poll_engine
from consumers.fleet import Fleet
from consumers.forwarding import FORWARD_SCAN_INTERVAL_MS, FORWARDED_BY_HEADER, PeerForwarding
from consumers.intake import ORIG_TS_HEADER
from consumers.membership import Membership, commit_points
from consumers.outcomes import Outcomes
from consumers.runners import make_runner
from consumers.runners.base import Output
from consumers.stats import ConsumerStats
from consumers.stop_budget import MIN_STEP_S, STOP_WORK_SHARE, StopBudget, step_s
from consumers.tasks import Work
from pipeline.core.config import BatchProfile, ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.core.engine import BatchingEngine
from pipeline.core.kafka.client import CLIENT_STOP_S, Topics
from pipeline.core.kafka.offsets import OffsetTracker
from pipeline.core.kafka.topic_limits import TopicLimits
from schemas.messages import FleetBeacon
from tests.support.clock import FakeClock

MODEL = "m"
TOPICS = Topics("loop")
REQUESTS = TOPICS.requests(MODEL)
PRIORITY = TOPICS.priority(MODEL)
GROUP = TOPICS.group(MODEL)


class Loop:
    """The loop's decision parts for one model, wired as `consumers.worker.Consumer` wires them."""

    def __init__(self, clock: FakeClock, profile: BatchProfile, *, prior_costs: list[tuple[int, float]] = ()) -> None:  # type: ignore[assignment]
        self.clock = clock
        self.model = ModelConfig(
            name=MODEL, runner="cost-model", cost_a_ms=1.0, cost_c_ms=0.0, partitions=2, profile=profile
        )
        runner = make_runner(self.model)
        runner.load()
        self.engine = BatchingEngine(profile, prior_costs=prior_costs)
        self.admission = Admission(self.model, runner, TOPICS, ConsumerSettings().max_message_bytes)
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self.stats = ConsumerStats()
        self.outcomes = Outcomes(Answers(MODEL, "c1", TOPICS, TopicLimits(KafkaSettings())), self.stats)
        self.offsets: dict[TopicPartition, int] = {}

    def fetch(self, records: list[ConsumerRecord]) -> list:
        by_partition: dict[TopicPartition, list[ConsumerRecord]] = {}
        for r in records:
            by_partition.setdefault(TopicPartition(r.topic, r.partition), []).append(r)
        return self.admission.intake(by_partition, self.clock.now_ms(), self.tracker, self.engine)

    def record(
        self,
        i: int,
        *,
        topic: str = REQUESTS,
        partition: int = 0,
        age_ms: float = 0.0,
        headers: list[tuple[str, bytes]] | None = None,
        **fields: Any,
    ) -> ConsumerRecord:
        offset = self.offsets.get(TopicPartition(topic, partition), 0)
        self.offsets[TopicPartition(topic, partition)] = offset + 1
        body = {"id": f"r{i}", "model": MODEL, "text": f"hello {i}", **fields}
        value = json.dumps(body).encode()
        key = body["id"].encode()
        created = int(self.clock.now_ms() - age_ms)
        return ConsumerRecord(
            topic, partition, offset, created, 0, key, value, None, len(key), len(value), headers or []
        )


def outcome_of(message) -> dict[str, Any]:
    return json.loads(message.value)


# ---- expiry ---------------------------------------------------------------------


def test_a_request_past_its_deadline_is_answered_expired_and_never_dispatched() -> None:
    clock = FakeClock()
    loop = Loop(clock, BatchProfile(hard_cap=8, target_size=8, max_wait_ms=500.0, adaptive_window=False))
    assert loop.fetch([loop.record(0, timeout_ms=50), loop.record(1, timeout_ms=5000)]) == []
    # the device is busy (its one slot taken): nothing can start, the engine only holds
    step = poll_engine(loop.engine, clock.now_ms(), computing=1, max_inflight=1, backlog=0)
    assert step.batches == [] and step.expired == []
    first_deadline = step.wake_at_ms
    assert first_deadline == pytest.approx(clock.now_ms() + 50, abs=1)

    # the loop asks again when the engine said, without any arrival: the alarm rings at the deadline
    rings: list[float] = []
    alarm = Alarm(clock, lambda: rings.append(clock.now_ms()))
    alarm.set(step.wake_at_ms)
    alarm.set(step.wake_at_ms)  # asked again for the same time: still one wake-up
    assert len(clock.pending_wakes) == 1
    clock.advance(49)
    assert rings == []
    clock.advance(2)
    assert rings == [first_deadline]

    step = poll_engine(loop.engine, clock.now_ms(), computing=1, max_inflight=1, backlog=0)
    assert [pr.request_id for pr in step.expired] == ["r0"] and step.batches == []
    reply = loop.outcomes.of_expiry(step.expired, clock.now_ms())
    (result,) = [outcome_of(m) for m in reply.messages if m.topic == TOPICS.results(MODEL)]
    (event,) = [outcome_of(m) for m in reply.messages if m.topic == TOPICS.latency_events]
    assert (result["id"], result["outcome"]) == ("r0", "expired")
    assert (event["outcome"], event["reason"], event["batch_size"]) == ("expired", "deadline", 0)
    assert reply.places == [(TopicPartition(REQUESTS, 0), 0)]
    assert loop.stats.answered["expired"] == 1

    # the device frees: only the request still in time runs; the expired one never again
    step = poll_engine(loop.engine, clock.now_ms() + 600, computing=0, max_inflight=1, backlog=0)
    assert [[pr.request_id for pr in b.requests] for b in step.batches] == [["r1"]]
    assert step.expired == [] and loop.engine.pending == 0


def test_what_cannot_be_served_in_time_is_answered_at_once_with_its_reason() -> None:
    clock = FakeClock()
    profile = BatchProfile(hard_cap=8, target_size=8, slo_p99_ms=100.0, batch_overhead_ms=0.0)
    loop = Loop(clock, profile, prior_costs=[(1, 10.0), (8, 40.0)])
    # 40 ms a batch of 8: two batches fit the 100 ms SLO, a third would end at 120 ms
    loop.fetch([loop.record(i, timeout_ms=5000) for i in range(24)] + [loop.record(99)])
    step = poll_engine(loop.engine, clock.now_ms(), computing=1, max_inflight=1, backlog=0)
    shed = [pr.request_id for pr in step.expired]
    assert shed == [f"r{i}" for i in range(16, 24)], "r99 has no deadline: never shed"
    assert loop.engine.pending == 17
    reply = loop.outcomes.of_expiry(step.expired, clock.now_ms())
    results = [outcome_of(m) for m in reply.messages if m.topic == TOPICS.results(MODEL)]
    events = [outcome_of(m) for m in reply.messages if m.topic == TOPICS.latency_events]
    assert [r["id"] for r in results] == shed == [e["request_id"] for e in events]
    assert {(r["outcome"], r["error"].split(":")[0]) for r in results} == {("expired", "cannot_meet_slo")}
    assert {(e["outcome"], e["reason"], e["batch_size"]) for e in events} == {("expired", "cannot_meet_slo", 0)}
    assert sorted(offset for _, offset in reply.places) == sorted(int(i[1:]) for i in shed)


def test_a_request_already_past_its_absolute_deadline_expires_on_the_first_decision() -> None:
    clock = FakeClock()
    loop = Loop(clock, BatchProfile(hard_cap=4, target_size=1))
    loop.fetch([loop.record(0, deadline_ms=int(clock.now_ms()) - 1000), loop.record(1)])
    step = poll_engine(loop.engine, clock.now_ms(), computing=0, max_inflight=1, backlog=0)
    assert [pr.request_id for pr in step.expired] == ["r0"]
    assert [pr.request_id for b in step.batches for pr in b.requests] == ["r1"]


def test_one_decision_fills_every_free_slot_and_no_more() -> None:
    clock = FakeClock()
    loop = Loop(clock, BatchProfile(hard_cap=2, target_size=2, max_inflight_batches=2))
    loop.fetch([loop.record(i) for i in range(7)])
    step = poll_engine(loop.engine, clock.now_ms(), computing=0, max_inflight=2, backlog=0)
    assert [b.size for b in step.batches] == [2, 2]
    assert poll_engine(loop.engine, clock.now_ms(), computing=2, max_inflight=2, backlog=0).batches == []
    clock.advance(5)
    loop.engine.completed(step.batches[0], clock.now_ms(), 5.0)
    assert [b.size for b in poll_engine(loop.engine, clock.now_ms(), 1, 2, 0).batches] == [2], "one slot freed"


# ---- forwarding -------------------------------------------------------------------


def beacon(
    member: str,
    *,
    at_ms: float,
    partitions: list[int],
    start_in_ms: float = 0.0,
    batch_ms: float = 3.0,
    capacity_per_s: float = 20_000.0,
    group: str = GROUP,
) -> FleetBeacon:
    return FleetBeacon(
        member_id=member,
        model=MODEL,
        group=group,
        at_ms=int(at_ms),
        start_in_ms=start_in_ms,
        batch_ms=batch_ms,
        capacity_per_s=capacity_per_s,
        partitions=partitions,
    )


def slow_loop(clock: FakeClock) -> tuple[Loop, PeerForwarding]:
    """A consumer whose device takes 200 ms + 20 ms per request (learned), in a group with beacons."""
    loop = Loop(
        clock,
        BatchProfile(hard_cap=4, target_size=4, max_wait_ms=1000.0, adaptive_window=False),
        prior_costs=[(1, 220.0), (2, 240.0), (4, 280.0)],
    )
    forwarding = PeerForwarding("c1", MODEL, GROUP, PRIORITY, ConsumerSettings(), loop.engine, clock)
    forwarding.fleet = Fleet(KafkaSettings(), GROUP, "c1", 100.0, lambda: forwarding.beacon(clock.now_ms(), ()), clock)
    return loop, forwarding


def test_the_back_of_a_slow_queue_goes_to_the_fast_peers_partitions_and_forwarded_requests_stay() -> None:
    clock = FakeClock()
    loop, forwarding = slow_loop(clock)
    fleet = forwarding.fleet
    assert fleet is not None
    now = clock.now_ms()
    # the peer would start a request in 450 ms: sooner than the back of this queue, not than its front
    fleet.heard(beacon("fast", at_ms=now - 5, partitions=[2, 5], start_in_ms=450.0), now)
    fleet.heard(beacon("busy", at_ms=now - 5, partitions=[3], start_in_ms=5000.0), now)
    fleet.heard(beacon("elsewhere", at_ms=now - 5, partitions=[4], group="loop.consumers.other"), now)
    fleet.heard(beacon("c1", at_ms=now - 5, partitions=[0]), now)  # its own beacon is not a peer
    assert sorted(p.member_id for p in fleet.peers()) == ["busy", "fast"]

    arrived_as_forward = [(ORIG_TS_HEADER, str(int(now - 30)).encode()), (FORWARDED_BY_HEADER, b"c0")]
    records = [loop.record(i) for i in range(10)]
    records += [loop.record(10 + i, topic=PRIORITY, headers=arrived_as_forward, priority=1) for i in range(4)]
    assert loop.fetch(records) == []
    assert loop.engine.pending == 14

    chosen = forwarding.plan(now, loop.admission.waiting.values(), room=1_000_000)
    ids = [pr.request_id for pr, _ in chosen]
    assert ids, "the peer takes the back of the queue"
    assert not {f"r{10 + i}" for i in range(4)} & set(ids), "a request that arrived as a forward never leaves again"
    assert "r0" not in ids, "the front of the queue finishes sooner here"
    assert ids == [f"r{i}" for i in range(9, 9 - len(ids), -1)], "the back first, without gaps"
    for pr, message in chosen:
        assert message.topic == PRIORITY and message.partition in (2, 5), "to a priority partition the fast peer owns"
        headers = dict(message.headers or [])
        assert headers[FORWARDED_BY_HEADER] == b"c1"
        assert int(headers[ORIG_TS_HEADER]) == pr.payload.enqueue_ms, "waiting counts from the first enqueue"
        assert message.value == pr.payload.raw
    assert len(chosen) >= 2 and {m.partition for _, m in chosen} == {2, 5}, "spread over the peer's partitions"
    assert fleet.sent == {"fast": len(chosen)}


def test_no_forward_without_room_on_the_priority_topic_or_a_fresh_peer() -> None:
    clock = FakeClock()
    loop, forwarding = slow_loop(clock)
    fleet = forwarding.fleet
    assert fleet is not None
    now = clock.now_ms()
    loop.fetch([loop.record(i) for i in range(10)])
    fleet.heard(beacon("fast", at_ms=now - 5, partitions=[2]), now)
    assert forwarding.plan(now, loop.admission.waiting.values(), room=None) == [], "limit unknown: they stay"
    assert forwarding.plan(now, loop.admission.waiting.values(), room=10) == [], "the topic would refuse them"
    later = now + 5000  # the peer's beacon is older than ForwardRule.stale_ms: it may be gone
    assert forwarding.plan(later, loop.admission.waiting.values(), room=1_000_000) == []


def test_scans_are_spaced_and_the_beacon_counts_the_device_busy_time() -> None:
    clock = FakeClock()
    loop, forwarding = slow_loop(clock)
    assert forwarding.due(clock.now_ms())
    clock.advance(FORWARD_SCAN_INTERVAL_MS / 2)
    assert not forwarding.due(clock.now_ms())
    clock.advance(FORWARD_SCAN_INTERVAL_MS / 2)
    assert forwarding.due(clock.now_ms())

    loop.fetch([loop.record(i) for i in range(4)])
    idle = forwarding.beacon(clock.now_ms(), (1,))
    (batch,) = poll_engine(loop.engine, clock.now_ms(), 0, 1, 0).batches
    forwarding.dispatched(batch, clock.now_ms())
    busy = forwarding.beacon(clock.now_ms(), (1,))
    assert busy.start_in_ms == pytest.approx(280.0) and idle.start_in_ms == pytest.approx(280.0)
    clock.advance(100)
    assert forwarding.beacon(clock.now_ms(), (1,)).start_in_ms == pytest.approx(180.0)
    forwarding.left_device(batch)
    assert forwarding.beacon(clock.now_ms(), (1,)).start_in_ms == 0.0
    assert busy.partitions == [1] and busy.capacity_per_s == pytest.approx(4 * 1000 / 280.0)


def test_a_generating_consumer_learns_its_decode_loop_and_hands_a_lone_arrival_to_a_faster_peer() -> None:
    """Iteration-level generation: the beacon speaks in generation's units (first-token time, decode
    step by rows, running requests, room) and every arrival is placed before it starts: a slow decode
    loop hands a new request to a peer whose steps are clearly shorter; a request on its device stays."""
    clock = FakeClock()
    loop = Loop(
        clock, BatchProfile(hard_cap=1, target_size=1, max_inflight_batches=8, adaptive_cap=False, max_wait_ms=0.0)
    )
    forwarding = PeerForwarding("c1", MODEL, GROUP, PRIORITY, ConsumerSettings(), loop.engine, clock, decode_slots=8)
    fleet = forwarding.fleet = Fleet(KafkaSettings(), GROUP, "c1", 100.0, lambda: forwarding.beacon(0.0, ()), clock)
    step = 180.0  # ms per token on this consumer's device, one request at a time
    for i in range(12):
        loop.fetch([loop.record(i, params={"max_new_tokens": 32})])
        (batch,) = poll_engine(loop.engine, clock.now_ms(), 0, 8, 0).batches
        start = clock.now_ms()
        loop.admission.running(batch.requests[0].payload)
        forwarding.dispatched(batch, start)
        clock.advance(200.0 + 31 * step)
        out = Output(text="x", tokens_out=32, first_token_ms=start + 200.0, last_token_ms=clock.now_ms())
        forwarding.answered(batch, {0: out}, clock.now_ms())
        forwarding.left_device(batch)
        loop.engine.completed(batch, clock.now_ms(), clock.now_ms() - start)
    now = clock.now_ms()
    mine = forwarding.beacon(now, (0,), free_slots=8)
    assert mine.first_token_ms == pytest.approx(200.0) and mine.room == 8 and mine.running == 0
    ((rows, step_ms),) = mine.decode_steps or []
    assert rows == 1 and step_ms == pytest.approx(step) and mine.start_in_ms == 0.0

    fast = msgspec.structs.replace(
        beacon("fast", at_ms=now - 5, partitions=[3]),
        first_token_ms=100.0, decode_steps=[(1, 60.0), (8, 90.0)], running=1, room=7, slot_every_ms=500.0,
    )  # fmt: skip
    fleet.heard(fast, now)
    fleet.heard(beacon("batches", at_ms=now - 5, partitions=[4]), now)  # a peer that speaks only in batches
    assert set(fleet.decode_peers()) == {"fast"}

    arrived_as_forward = [(ORIG_TS_HEADER, str(int(now - 30)).encode()), (FORWARDED_BY_HEADER, b"c0")]
    loop.fetch([loop.record(100, topic=PRIORITY, headers=arrived_as_forward, params={"max_new_tokens": 32})])
    assert forwarding.due(now, device_free=True), "one waiting request is placed before it starts"
    assert forwarding.plan(now, loop.admission.waiting.values(), room=1_000_000, free_slots=8) == [], "a forward stays"
    (kept,) = poll_engine(loop.engine, now, 0, 8, 0).batches
    loop.admission.running(kept.requests[0].payload)
    forwarding.dispatched(kept, now)
    loop.fetch([loop.record(101, params={"max_new_tokens": 32})])
    chosen = forwarding.plan(now, loop.admission.waiting.values(), room=1_000_000, free_slots=7)
    assert [(pr.request_id, m.partition) for pr, m in chosen] == [("r101", 3)]
    assert forwarding.decode is not None and forwarding.decode.running == 1, "what runs here stays here"


# ---- commit points -----------------------------------------------------------------


def test_commits_stop_at_the_first_unanswered_record_of_each_owned_partition() -> None:
    clock = FakeClock()
    loop = Loop(clock, BatchProfile(hard_cap=2, target_size=2, max_inflight_batches=4))
    p0, p1 = TopicPartition(REQUESTS, 0), TopicPartition(REQUESTS, 1)
    records = [loop.record(0), loop.record(1)]
    records += [loop.record(99, partition=0, model="not-this-one"), loop.record(2), loop.record(3, partition=1)]
    rejected = loop.fetch(records)
    assert [(r.offset, why.reason) for r, why in rejected] == [(2, "model_mismatch")]
    assert commit_points(loop.tracker, {p0, p1}) == {p0: 0, p1: 0}, "nothing answered: nothing moves"

    step = poll_engine(loop.engine, clock.now_ms(), 0, 4, 0)
    first, second = step.batches  # r0 r1 | r2 r3
    for place in loop.outcomes.of_refusals(rejected, 0, 0).places + [
        (p.payload.tp, p.payload.offset) for p in second.requests
    ]:
        loop.tracker.answered(*place)
    # p0: offset 0 (r0) is still running, so p0 cannot move past it although 2 and 3 are answered
    assert commit_points(loop.tracker, {p0, p1}) == {p0: 0, p1: 1}
    assert commit_points(loop.tracker, {p0}) == {p0: 0}, "a partition no longer owned is the new owner's"
    for pr in first.requests:
        loop.tracker.answered(pr.payload.tp, pr.payload.offset)
    assert commit_points(loop.tracker, {p0, p1}) == {p0: 4, p1: 1}
    loop.tracker.committed({p0: 4, p1: 1})
    assert commit_points(loop.tracker, {p0, p1}) == {}, "committed once"


def test_a_revoked_partition_takes_its_waiting_requests_out_of_the_engine() -> None:
    clock = FakeClock()
    loop = Loop(clock, BatchProfile(hard_cap=8, target_size=8, max_wait_ms=1000.0, adaptive_window=False))
    loop.fetch([loop.record(0, partition=0), loop.record(1, partition=1), loop.record(2, partition=0)])
    membership = Membership("c1", PRIORITY, loop.engine, loop.admission, Work(clock, lambda e: None).settle)
    assert membership.owned() == set() and membership.owned_priority() == ()

    asyncio.run(membership.on_partitions_revoked({TopicPartition(REQUESTS, 0)}))
    assert loop.engine.pending == 1
    assert [pr.request_id for pr in loop.admission.waiting.values()] == ["r1"]
    step = poll_engine(loop.engine, clock.now_ms() + 2000, 0, 1, 0)
    assert [pr.request_id for b in step.batches for pr in b.requests] == ["r1"], "the next owner answers r0 and r2"


# ---- the stop budget -----------------------------------------------------------------


def test_the_stop_budget_gives_the_work_its_share_and_the_rest_to_commit_and_close() -> None:
    clock = FakeClock()
    timeout_s = 25.0
    budget = StopBudget.starting(clock.monotonic_s(), timeout_s)
    work_s = STOP_WORK_SHARE * timeout_s
    assert budget.working(clock.monotonic_s()) and budget.work_left_s(clock.monotonic_s()) == pytest.approx(work_s)
    clock.advance(work_s * 1000 - 1)
    assert budget.working(clock.monotonic_s())
    clock.advance(1)
    assert not budget.working(clock.monotonic_s()) and budget.work_left_s(clock.monotonic_s()) == 0.0
    rest_s = timeout_s - work_s
    # commit, then the consumer, then the producer: each an equal share of what is left
    assert step_s(budget, clock.monotonic_s(), 3) == pytest.approx(rest_s / 3)
    clock.advance(rest_s / 3 * 1000)
    assert step_s(budget, clock.monotonic_s(), 2) == pytest.approx(rest_s / 3)
    clock.advance(rest_s * 1000)  # the broker ate it all: each client still gets its minimum
    assert step_s(budget, clock.monotonic_s(), 1) == MIN_STEP_S
    assert step_s(None, clock.monotonic_s(), 2) == CLIENT_STOP_S, "ended by an error: no stop budget"


def test_a_generation_the_decode_loop_refused_is_answered_expired_with_its_reason() -> None:
    from consumers.answers import BatchTiming
    from consumers.runners.base import Output

    clock = FakeClock(1_000_000.0)
    loop = Loop(clock, BatchProfile(max_wait_ms=0.0))
    loop.fetch([loop.record(0), loop.record(1)])
    step = poll_engine(loop.engine, clock.now_ms(), computing=0, max_inflight=1, backlog=0)
    (batch,) = step.batches
    stamp = int(clock.now_ms())
    outputs = {
        0: Output(text="", token_ids=[], expired=True, refused="cannot_meet_deadline"),
        1: Output(text="hi", token_ids=[5], tokens_out=1),
    }
    reply = loop.outcomes.of_batch(batch, outputs, {}, BatchTiming(stamp, stamp, stamp, stamp, 0, "none"), 1.0)
    results = {r["id"]: r for r in (outcome_of(m) for m in reply.messages if m.topic == TOPICS.results(MODEL))}
    events = {e["request_id"]: e for e in (outcome_of(m) for m in reply.messages if m.topic == TOPICS.latency_events)}
    assert results["r0"]["outcome"] == "expired" and results["r0"]["error"].startswith("refused before its prefill")
    assert (events["r0"]["outcome"], events["r0"]["reason"]) == ("expired", "cannot_meet_deadline")
    assert (results["r1"]["outcome"], events["r1"]["reason"]) == ("ok", "")
