"""Forwarding in generation's units (pipeline.core.engine.decode_forwarding), on a virtual clock.

Each consumer's ledger is fed the dispatches and answers a decode loop of a known step curve would
give; the plan is then asked what leaves, and to whom.
"""

from __future__ import annotations

import math

import pytest

from pipeline.core.engine.decode_forwarding import (
    DecodeLedger,
    DecodePeer,
    DecodeRule,
    DecodeState,
    local_tokens_ms,
    peer_tokens_ms,
    plan_decode_forwards,
    step_ms,
)
from tests.support.clock import FakeClock

TOKENS = 64


def fast_step(rows: float) -> float:
    """A decode step of SmolLM2 on one core, roughly: 50 ms, +5 ms a row."""
    return 50.0 + 5.0 * rows


def slow_step(rows: float) -> float:
    return 2.0 * fast_step(rows)


def served(
    step,
    rows: int,
    *,
    clock: FakeClock | None = None,
    slots: int = 32,
    answers: int = 24,
    prefill_ms: float = 100.0,
    hold: bool = True,
) -> tuple[DecodeLedger, FakeClock]:
    """A ledger that watched `answers` requests decode `TOKENS` tokens among `rows` requests on a device
    of step curve `step`, and then (`hold`) holds `rows` requests on the device, dispatched at staggered times."""
    clock = clock or FakeClock()
    ledger = DecodeLedger(slots)
    life = prefill_ms + (TOKENS - 1) * step(rows)
    for k in range(answers):
        start = clock.now_ms()
        ids = [f"a{k}-{r}" for r in range(rows)]
        for rid in ids:
            ledger.dispatched(rid, start, TOKENS)
        clock.advance(life)
        for rid in ids:
            ledger.answered(rid, clock.now_ms(), start + prefill_ms, start + life, TOKENS)
    for r in range(rows if hold else 0):  # the running set now: one request every life/rows, the oldest near its end
        ledger.dispatched(f"run-{r}", clock.now_ms() - life + (r + 1) * life / rows, TOKENS)
    return ledger, clock


def peer(name: str, state: DecodeState, at_ms: float, parts=(0, 1)) -> DecodePeer:
    return DecodePeer(name, at_ms, tuple(parts), state)


def test_the_ledger_learns_the_first_token_time_the_step_by_rows_and_how_long_answers_run() -> None:
    ledger, clock = served(fast_step, 4)
    assert ledger.first_token_ms() == pytest.approx(100.0)
    assert ledger.typical_tokens() == TOKENS
    steps = ledger.steps()
    assert step_ms(steps, 4) == pytest.approx(fast_step(4), rel=0.05), steps
    assert ledger.running == 4
    local = ledger.local(clock.now_ms(), room=28)
    assert local.running == 4 and local.room == 28
    assert local.ends_ms == tuple(sorted(local.ends_ms)) and local.ends_ms[0] < local.ends_ms[-1]
    assert local.ends_ms[-1] == pytest.approx(100.0 + (TOKENS - 1) * fast_step(4)), (
        "the newest ends a whole life from now"
    )
    more, _ = served(fast_step, 12, clock=clock)
    assert step_ms(more.steps(), 12) == pytest.approx(fast_step(12), rel=0.05)


def test_a_full_consumer_starts_the_next_request_when_its_first_running_request_ends() -> None:
    ledger, clock = served(fast_step, 8, slots=8)
    now = clock.now_ms()
    full = ledger.state(now, room=0, waiting=0)
    assert full.room == 0
    assert full.start_in_ms == pytest.approx(ledger.local(now, 0).ends_ms[0])
    assert 0 < full.start_in_ms < 100.0 + TOKENS * fast_step(8)
    behind = ledger.state(now, room=0, waiting=3)
    assert behind.start_in_ms > full.start_in_ms, "three waiting ahead: the fourth end"
    assert ledger.state(now, room=4, waiting=0).start_in_ms == 0.0, "room: at once"
    assert ledger.state(now, room=4, waiting=4).start_in_ms > 0.0, "room taken by the queue"


def test_a_slow_consumer_hands_a_new_request_to_a_faster_peer_with_room_and_never_the_reverse() -> None:
    slow, clock = served(slow_step, 6, prefill_ms=200.0)
    fast, _ = served(fast_step, 6, clock=FakeClock(clock.now_ms() - 1e6))
    now = clock.now_ms()
    fast_state, slow_state = fast.state(now, room=26, waiting=0), slow.state(now, room=26, waiting=0)
    rule = DecodeRule()
    plan = plan_decode_forwards([TOKENS], [True], slow.local(now, 26), [peer("fast", fast_state, now)], now, rule)
    assert [(f.index, f.member_id) for f in plan] == [(0, "fast")]
    assert plan_decode_forwards([TOKENS], [True], fast.local(now, 26), [peer("slow", slow_state, now)], now, rule) == []


def test_equal_consumers_keep_their_own_requests_but_a_full_one_hands_its_queue_to_a_twin_with_room() -> None:
    one, clock = served(fast_step, 6, slots=8)
    two, _ = served(fast_step, 5, clock=FakeClock(clock.now_ms() - 1e6), slots=8)
    now = clock.now_ms()
    rule = DecodeRule()
    twin = peer("two", two.state(now, room=3, waiting=0), now)
    assert plan_decode_forwards([TOKENS] * 2, [True] * 2, one.local(now, 2), [twin], now, rule) == [], "noise"
    # `one` is full with six waiting: the back of its queue would wait for whole answers to end here
    plan = plan_decode_forwards([TOKENS] * 6, [True] * 6, one.local(now, 0), [twin], now, rule)
    assert plan, "a backlog moves to the twin with room"
    assert [f.index for f in plan] == list(range(5, 5 - len(plan), -1)), "from the back, without gaps"
    assert len(plan) < 6, "the front of the queue starts sooner here"


def test_requests_on_the_device_and_forwards_in_never_move() -> None:
    slow, clock = served(slow_step, 6, slots=6)
    fast, _ = served(fast_step, 2, clock=FakeClock(clock.now_ms() - 1e6))
    now = clock.now_ms()
    fast_peer = peer("fast", fast.state(now, room=30, waiting=0), now)
    running_before = slow.running
    plan = plan_decode_forwards(
        [TOKENS] * 4, [True, False, True, False], slow.local(now, 0), [fast_peer], now, DecodeRule()
    )
    assert sorted(f.index for f in plan) == [0, 2], "only the queue's movable requests"
    assert slow.running == running_before, "the running set is not a candidate at all"


def test_each_forward_takes_the_peers_room_and_grows_its_rows_so_one_scan_cannot_flood_it() -> None:
    slow, clock = served(slow_step, 8, slots=8)
    fast, _ = served(fast_step, 8, clock=FakeClock(clock.now_ms() - 1e6), slots=10)
    now = clock.now_ms()
    state = fast.state(now, room=2, waiting=0)
    rule = DecodeRule()
    sent: dict[str, int] = {}
    plan = plan_decode_forwards(
        [TOKENS] * 40, [True] * 40, slow.local(now, 0), [peer("fast", state, now)], now, rule, sent
    )
    assert 2 < len(plan) < 40, "past its room the peer's slots free as its answers end: it is not bottomless"
    assert sent == {"fast": len(plan)}
    assert [f.partition for f in plan[:4]] == [0, 1, 0, 1], "spread over the peer's priority partitions"
    first_two = [peer_tokens_ms(state, k, TOKENS, rule, 0.0, slow.local(now, 0))[0] for k in range(4)]
    assert first_two[0] == first_two[1] < first_two[2] < first_two[3], "room first, then one end per request"
    again = plan_decode_forwards(
        [TOKENS] * 40, [True] * 40, slow.local(now, 0), [peer("fast", state, now)], now, rule, sent
    )
    assert len(again) < len(plan), "what was sent since the beacon still counts"


def test_no_forward_for_an_earlier_first_token_that_makes_the_answer_later_or_the_reverse() -> None:
    local, clock = served(fast_step, 6)
    now = clock.now_ms()
    here = local.local(now, 26)
    rule = DecodeRule(relief_speed=0.0)  # twins' margins throughout
    first_here, last_here = local_tokens_ms(0, TOKENS, here)
    # a peer that would start it at once but decode it on a crowded, slow step
    crowded = DecodeState(0.0, 20.0, ((1, 60.0), (64, 400.0)), running=60, room=4, slot_every_ms=50.0)
    first_there, last_there = peer_tokens_ms(crowded, 0, TOKENS, rule, 0.0, here)
    assert first_there < first_here and last_there > last_here
    assert plan_decode_forwards([TOKENS], [True], here, [peer("crowded", crowded, now)], now, rule) == []
    # a peer that decodes fast but is full: the answer would end sooner there, the first token later
    full = DecodeState(2000.0, 50.0, ((1, 5.0), (64, 10.0)), running=64, room=0, slot_every_ms=50.0)
    first_there, last_there = peer_tokens_ms(full, 0, TOKENS, rule, 0.0, here)
    assert first_there > first_here and last_there < last_here
    assert plan_decode_forwards([TOKENS], [True], here, [peer("full", full, now)], now, rule) == []


def test_a_stale_peer_gets_nothing_and_one_that_measured_nothing_gets_one_request_per_beacon() -> None:
    slow, clock = served(slow_step, 8, slots=8)
    now = clock.now_ms()
    local = slow.local(now, 0)
    rule = DecodeRule()
    fresh_state = DecodeState(0.0, 0.0, (), running=0, room=32, slot_every_ms=0.0)
    stale = peer("gone", fresh_state, now - rule.stale_ms - 1)
    assert plan_decode_forwards([TOKENS] * 4, [True] * 4, local, [stale], now, rule) == []
    plan = plan_decode_forwards([TOKENS] * 4, [True] * 4, local, [peer("new", fresh_state, now)], now, rule)
    assert [f.index for f in plan] == [3]
    assert peer_tokens_ms(fresh_state, 1, TOKENS, rule, 0.0, local) == (math.inf, math.inf)


def test_a_consumer_that_slows_down_says_so_within_a_few_answers() -> None:
    """A co-tenant takes half of the core: answers come at twice the time per output token and the
    first-token time, the learned step follows within a dozen answers (a shift of the curve)."""
    ledger, clock = served(fast_step, 6, answers=12, hold=False)
    before = step_ms(ledger.steps(), 6)
    assert before is not None
    for k in range(2):  # two groups of six slowed answers
        for r in range(6):
            ledger.dispatched(f"s{k}-{r}", clock.now_ms(), TOKENS)
        clock.advance(200.0 + (TOKENS - 1) * slow_step(6))
        now = clock.now_ms()
        for r in range(6):
            ledger.answered(f"s{k}-{r}", now, now - (TOKENS - 1) * slow_step(6), now, TOKENS)
    assert step_ms(ledger.steps(), 6) == pytest.approx(2 * before, rel=0.05)
    assert ledger.first_token_ms() == pytest.approx(100.0), "12 of the last 32 answers were slow: not yet their median"
