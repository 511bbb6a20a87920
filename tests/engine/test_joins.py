"""The decode loop's admission rule (shared by the consumer's loop and the generation simulator)."""

from __future__ import annotations

import pytest

from pipeline.core.engine.joins import (
    LEARN_AFTER,
    MAX_PADDING,
    MIN_CHUNK,
    OLDEST_SHARE,
    RIDE_GROWTH,
    RIDE_SHARE,
    Decoding,
    Joiner,
    JoinRule,
    JoinSettings,
    LoopView,
    RideCredit,
    Waiting,
    late_for_first_token,
    length_groups,
    paced_ride,
    ride_allowance,
    ride_plan,
    ride_tokens,
    rides_late,
    rides_ms,
    stall_room,
    vouched_ride,
)


def joiner(
    prompt: int = 32, limit: int = 100, deadline: float | None = None, priority: int = 1, step: int = 0
) -> Joiner:
    return Joiner(prompt, prompt + limit, limit, deadline, priority, step)


VIEW = LoopView(running=4, reserved=0, last_step_ms=20.0, steps=10, size_at_join=4)


def test_length_groups_keep_padding_within_bound_and_cover_every_joiner() -> None:
    prompts = [20, 1800, 25, 400, 30, 450, 2000, 22]
    groups = length_groups(prompts)
    assert sorted(k for g in groups for k in g) == list(range(len(prompts)))
    for g in groups:
        widths = [prompts[k] for k in g]
        assert len(widths) * max(widths) <= MAX_PADDING * sum(widths)
    assert len(groups) == 3  # the short ones, the ~400s, the ~2000s


def test_hopeless_is_judged_by_the_learned_answer_lengths() -> None:
    rule = JoinRule(JoinSettings())
    late = joiner(limit=100, deadline=1000.0)  # 100 x 20 ms from 0 ends at 2000: past 1000
    for _ in range(LEARN_AFTER - 1):
        rule.learn(90)
    assert rule.refused([late], VIEW, 0.0) == []  # too few answers: no evidence to refuse on
    assert rule.admit([late], VIEW.__class__(0, 0, 20.0, 10, 0), 0.0) == [0]
    rule.learn(90)
    assert rule.refused([late], VIEW, 0.0) == [0]  # the p75 answer (90 x 20 ms) ends too late
    for _ in range(10 * LEARN_AFTER):
        rule.learn(10)
    assert rule.expected_tokens(100) == 10
    assert rule.refused([late], VIEW, 0.0) == []  # 10 x 20 ms ends in time
    assert rule.expected_tokens(5) == 5  # never over its own limit


def test_nothing_is_refused_with_an_empty_set_or_without_deadline() -> None:
    rule = JoinRule(JoinSettings())
    idle = LoopView(running=0, reserved=0, last_step_ms=20.0, steps=10, size_at_join=0)
    assert rule.refused([joiner(deadline=1.0)], idle, 0.0) == []
    assert rule.refused([joiner()], VIEW, 0.0) == []
    assert JoinRule(JoinSettings(refuse_hopeless=False)).refused([joiner(deadline=1.0)], VIEW, 0.0) == []


def test_urgent_joiners_take_the_room_first() -> None:
    rule = JoinRule(JoinSettings(token_cap=300))
    waiting = [joiner(priority=1), joiner(priority=1), joiner(priority=0), joiner(priority=0)]
    assert rule.admit(waiting, VIEW, 0.0) == [2, 3]  # 132 tokens each: two fit, the urgent ones


def test_a_join_waits_for_company_until_it_pays() -> None:
    rule = JoinRule(JoinSettings())
    assert rule.admit([joiner(step=8)], VIEW, 0.0) == []
    assert rule.admit([joiner(step=4)], VIEW, 0.0) == [0]  # waited 6 steps
    assert rule.admit([joiner(step=9)] * 4, VIEW, 0.0) == [0, 1, 2, 3]


def test_a_group_rides_while_rows_decode() -> None:
    rule = JoinRule(JoinSettings(tpot_ms=50.0, step_token_budget=128))
    assert not rule.one_piece(running=8)  # rows decode: it rides, whatever its size
    assert rule.one_piece(running=0)  # nobody to stall
    assert JoinRule(JoinSettings(step_token_budget=0)).one_piece(running=4)  # chunking off


def test_a_join_that_rides_does_not_wait_for_company() -> None:
    riding = JoinRule(JoinSettings(step_token_budget=128))
    assert riding.admit([joiner(step=9)], VIEW, 0.0) == [0]  # rows decode: it rides, it stalls nobody
    stalling = JoinRule(JoinSettings(step_token_budget=0))
    assert stalling.admit([joiner(step=9)], VIEW, 0.0) == []  # a one-piece prefill still waits for company
    capped = JoinRule(JoinSettings(token_cap=300, step_token_budget=128))
    assert capped.admit([joiner(priority=1), joiner(priority=0), joiner(priority=0)], VIEW, 0.0) == [1, 2]


def test_a_tpot_objective_fills_its_slack_with_ridden_tokens() -> None:
    # a 30 ms plain step, 0.1 ms a ridden token, an objective of 50 ms: 20 ms of slack, 200 tokens
    assert ride_tokens(64, 30.0, 0.1, 50.0) == 200
    assert ride_tokens(64, 30.0, 0.1, None) == 64  # no objective: the paced share
    assert ride_tokens(64, 45.0, 0.1, 50.0) == 50  # little slack: never past the objective
    assert ride_tokens(64, 49.5, 0.1, 50.0) == MIN_CHUNK  # the prompt still moves
    assert ride_tokens(64, 60.0, 0.1, 50.0) == 64  # the plain step misses it already: the share
    assert ride_tokens(2, 60.0, 0.1, None) == MIN_CHUNK  # the prompt moves


def test_a_ride_with_a_fixed_part_carries_what_the_fixed_part_costs_and_waits_until_it_is_paid() -> None:
    # a 100 ms plain step may gain RIDE_SHARE (35 ms) a step; no fixed part: 1 ms a token, 35 tokens
    assert ride_allowance(100.0, None) == pytest.approx(RIDE_SHARE * 100.0)
    assert paced_ride(128, 10, 100.0, 1.0, None) == 35
    # a 20 ms fixed part: what is left of the share, 15 tokens, would be mostly fixed cost: 20 tokens
    assert paced_ride(128, 10, 100.0, 1.0, None, fixed_ms=20.0) == 20
    assert paced_ride(128, 10, 100.0, 1.0, None, fixed_ms=5.0) == 30  # a small one: the share beside it
    assert paced_ride(128, 100, 100.0, 0.1, None, fixed_ms=50.0) == 28  # within the budget beside the rows
    assert paced_ride(128, 10, 30.0, 1.0, 50.0, fixed_ms=5.0) == 15  # an objective's slack (20 ms) beside it
    assert ride_allowance(30.0, 50.0) == 20.0 and ride_allowance(60.0, 50.0) == pytest.approx(RIDE_SHARE * 60.0)
    credit = RideCredit()
    assert credit.due(35.0)
    rides = 0
    while credit.due(35.0):  # 20-token rides adding 40 ms where 35 are allowed: 5 ms owed each
        credit.rode(40.0, 35.0)
        rides += 1
    assert rides == 7  # 35 ms owed: one plain step pays it back
    credit.plain(35.0)
    assert credit.due(35.0) and credit.owed_ms == 0.0  # 280 ms added over 8 steps: 35 a step
    credit.rode(30.0, 35.0)  # a ride under the allowance banks nothing
    assert credit.owed_ms == 0.0
    credit.rode(105.0, 35.0)
    steps = 0
    while not credit.due(35.0):
        credit.plain(35.0)
        steps += 1
    assert steps == 2  # 105 ms added over three steps: 35 a step on average
    assert RideCredit().due(0.0)  # nothing owed: a ride goes even before a plain step was timed


def test_with_a_tpot_objective_a_ride_grows_only_as_far_as_the_recent_rides_vouch() -> None:
    """A 61 ms plain step and a 307 ms objective: 246 ms of slack. A fit to rides of about 50 tokens
    that put their whole time in the fixed part (80 ms, 0.05 ms a token) asked for 3,320 tokens in
    one step, where a real ride of 50 tokens took 240 ms; the largest ride's time per token (4.8 ms)
    lets it grow to 51 tokens. Rides that added little grow at most RIDE_GROWTH x the largest."""
    step, tpot, fixed, per_token = 61.0, 307.0, 80.0, 0.05
    assert paced_ride(128, 10, step, per_token, tpot, fixed) == 3320  # unbounded before any ride
    recent = [(48, 236.0), (50, 240.0), (49, 231.0)]
    assert paced_ride(128, 10, step, per_token, tpot, fixed, recent) == 51
    assert vouched_ride(3320.0, recent, 246.0) == pytest.approx(246.0 * 50 / 240.0)
    assert paced_ride(128, 10, step, 1.0, tpot, 0.0, [(20, 20.0), (10, 10.0)]) == RIDE_GROWTH * 20
    assert paced_ride(128, 10, step, 1.0, tpot, 0.0, [(300, 300.0)]) == 246  # within the rides: the fit's
    assert vouched_ride(100.0, [(60, 400.0)], 246.0) == 60.0  # past the allowance: no larger than the largest
    # without an objective the step's token budget bounds the ride, whatever the rides were
    assert paced_ride(128, 10, 100.0, 0.05, None, 0.0, recent) == 118


def test_a_ride_spends_its_tokens_short_groups_whole_within_half_the_oldest_the_rest() -> None:
    assert ride_plan([1000, 50, 30, 500], 128) == [(0, 98), (2, None)]  # 30 whole within half; 50 does not fit there
    assert ride_plan([1000, 10, 20, 30, 40], 128) == [(0, 68), (1, None), (2, None), (3, None)]
    assert ride_plan([40, 30, 500], 128) == [(0, None), (1, None), (2, 58)]  # the oldest done: the rest, oldest first
    assert ride_plan([100, 50, 400], 300) == [(0, None), (1, None), (2, 150)]  # nothing of the ride left unspent
    assert ride_plan([40, 30], 128) == [(0, None), (1, None)]  # everything fits
    assert ride_plan([125, 200], 128) == [(0, None)]  # 3 tokens left: under MIN_CHUNK, the next one waits
    assert ride_plan([1000], 2) == [(0, MIN_CHUNK)]  # the oldest moves MIN_CHUNK at least
    for remaining, tokens in (([5000] + [20] * 30, 256), ([300, 299, 298], 64)):
        oldest = ride_plan(remaining, tokens)[0]
        assert oldest[0] == 0 and oldest[1] is not None and oldest[1] >= OLDEST_SHARE * tokens  # never starved


def test_late_for_first_token_gives_up_only_what_no_prefill_order_could_save() -> None:
    """At 2 ms a token from t=0: the first prompt (100 tokens, due at 250) makes it; the second (100
    more, due at 300) cannot (400 > 300) and is given up, so its tokens no longer delay the third
    (100 + 100 tokens ahead of it: 400 <= 700). A started prompt and one without an objective are
    never given up, but their tokens count for those behind them (the last: 500 tokens, 1000 <= 1300)."""
    waiting = [
        Waiting(250.0, 100, False),
        Waiting(300.0, 100, False),
        Waiting(700.0, 100, False),
        Waiting(10.0, 50, True),
        Waiting(None, 50, False),
        Waiting(1300.0, 200, False),
    ]
    assert late_for_first_token(waiting, 0.0, 2.0) == [1]
    assert late_for_first_token(waiting, 200.0, 2.0) == [0, 1]
    assert late_for_first_token(waiting, 0.0, 3.0) == [0, 5]
    assert late_for_first_token(waiting, 0.0, None) == [] and late_for_first_token(waiting, 0.0, 0.0) == []


def test_a_stall_fits_what_the_rows_banked_and_what_their_remaining_tokens_pay_back() -> None:
    """TPOT 50 ms, plain steps of 30 ms: a row 11 tokens in after 300 ms banked 200 ms, and each of
    its 10 remaining tokens pays 20 ms back; the room is the least over the rows."""
    rows = [Decoding(0.0, 11, 10), Decoding(200.0, 3, 2)]
    room, banked = stall_room(rows, 300.0, 30.0, 50.0)
    # row 0: 50 x 10 - 300 + 10 x 20 = 400; row 1: 50 x 2 - 100 + 2 x 20 = 40
    assert (room, banked) == pytest.approx((40.0, 0.0))
    assert stall_room(rows[:1], 300.0, 30.0, 50.0) == pytest.approx((400.0, 200.0))
    assert stall_room(rows, 300.0, 30.0, None) == (0.0, 0.0)  # no objective: no stall is weighed
    assert stall_room(rows, 300.0, 60.0, 50.0) == (0.0, 0.0)  # the plain step misses it already
    assert stall_room([Decoding(0.0, 2, 0)], 300.0, 30.0, 50.0) == (0.0, 0.0)  # late already: none
    # a row given the stall, then its remaining tokens at plain steps, meets the objective exactly
    first, emitted, remaining, now, step, tpot = 0.0, 11, 10, 300.0, 30.0, 50.0
    stall, _ = stall_room([Decoding(first, emitted, remaining)], now, step, tpot)
    assert (now + stall + remaining * step - first) / (emitted - 1 + remaining) == pytest.approx(tpot)


def test_a_stall_is_owed_beyond_what_the_rows_banked() -> None:
    credit = RideCredit()
    credit.stalled(300.0, 200.0)
    assert credit.owed_ms == pytest.approx(100.0)
    assert not credit.due(20.0)  # rides wait while the plain steps pay the 100 ms back
    for _ in range(4):
        credit.plain(20.0)
    assert not credit.due(20.0) and credit.owed_ms == pytest.approx(20.0)
    credit.plain(20.0)
    assert credit.due(20.0)
    credit.stalled(50.0, 80.0)  # banked: nothing owed
    assert credit.owed_ms == 0.0


def test_rows_remaining_tokens_are_judged_short_or_known_exactly() -> None:
    rule = JoinRule(JoinSettings())
    assert rule.remaining_tokens(5, 100, exact=False) == 0  # nothing learned: no room is promised
    assert rule.remaining_tokens(5, 100, exact=True) == 95  # a replayed trace's answer runs to its limit
    for tokens in range(10, 10 + 4 * LEARN_AFTER, 4):
        rule.learn(tokens)
    short = sorted(range(10, 10 + 4 * LEARN_AFTER, 4))[int(0.25 * (4 * LEARN_AFTER // 4 - 1))]
    assert rule.remaining_tokens(5, 100, exact=False) == short - 5
    assert rule.remaining_tokens(5, 8, exact=False) == 3  # never past its limit
    assert rule.remaining_tokens(100, 200, exact=False) == 0


def test_a_group_is_prefilled_in_one_piece_while_rows_decode_only_when_its_stall_fits_and_nothing_rides() -> None:
    rule = JoinRule(JoinSettings(step_token_budget=128))
    assert rule.stall_fits(300.0, 400.0, 0, rides_ms=600.0)
    assert not rule.stall_fits(500.0, 400.0, 0, rides_ms=600.0)
    assert not rule.stall_fits(300.0, 400.0, 1, rides_ms=600.0)  # it would delay the rides of the queued prompts
    assert not rule.stall_fits(300.0, 400.0, 0, rides_ms=500.0)  # riding is nearly as soon
    assert not JoinRule(JoinSettings(step_token_budget=0)).stall_fits(300.0, 400.0, 0, rides_ms=600.0)


def test_a_prompt_late_on_rides_is_prefilled_at_once_when_that_saves_it_and_the_rows_can_spare_it() -> None:
    # 1000 tokens left at 100 a ride, a ride every 60 ms: 600 ms; by 500 ms it is late, by 700 ms not
    assert rides_ms(1000, 100, 60.0) == 600.0 and rides_ms(1001, 100, 60.0) == 660.0
    assert rides_late(1000, 100, 60.0, 0.0, 500.0)
    assert not rides_late(1000, 100, 60.0, 0.0, 700.0)
    assert not rides_late(1000, 100, 60.0, 0.0, None)
    rule = JoinRule(JoinSettings(step_token_budget=128))
    assert rule.rescue(300.0, 400.0, 0.0, 500.0)
    assert not rule.rescue(300.0, 200.0, 0.0, 500.0)  # the rows cannot spare the stall
    assert not rule.rescue(300.0, 400.0, 300.0, 500.0)  # in one piece it is late as well
    assert not rule.rescue(300.0, 400.0, 0.0, None)
