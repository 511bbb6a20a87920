"""The generation simulator: prefill and decode steps of a running set that rows join and leave."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.core.config import BatchProfile
from pipeline.core.engine import BatchingEngine
from pipeline.core.engine.joins import JOIN_WAIT_STEPS
from pipeline.core.profile_file import GenerationCurves
from pipeline.core.sim.generation.cost import GenerationCost
from pipeline.core.sim.generation.decode_loop import (
    GenArrivals,
    LoopSettings,
    running_token_cap,
    simulate_generation,
)
from pipeline.core.sim.generation.figures import gen_figures

PREFILL_A, PREFILL_C, STEP_A, STEP_C = 40.0, 2.0, 50.0, 5.0
COST = GenerationCost.linear(PREFILL_A, PREFILL_C, STEP_A, STEP_C)
NEW = 16


def arrivals(
    times: list[float], prompts: list[int], emits: list[int], deadline: float | None = None, limit: int = NEW
) -> GenArrivals:
    n = len(times)
    t = np.asarray(times, dtype=float)
    return GenArrivals(
        create_ms=t,
        deliver_ms=t.copy(),
        prompt=np.asarray(prompts),
        emits=np.asarray(emits),
        limit=np.full(n, limit),
        priority=np.zeros(n, dtype=int),
        lane=np.zeros(n, dtype=int),
        deadline_ms=t + deadline if deadline is not None else np.full(n, np.nan),
    )


def run(arr: GenArrivals, settings: LoopSettings | None = None, inflight: int = 16, cost: GenerationCost = COST):
    profile = BatchProfile(
        cost_unit="tokens",
        hard_cap=512,
        target_size=48,
        max_wait_ms=0.0,
        max_inflight_batches=inflight,
        tail_mark_ratio=0.0,
        shed_when="never",
    )
    engine = BatchingEngine(profile)
    return simulate_generation(arr, cost, [engine], settings or LoopSettings(reserve_tokens=NEW), inflight)


def test_one_row_is_a_prefill_and_a_step_per_token_after_the_first() -> None:
    out = run(arrivals([0.0], [32], [10]))
    prefill = PREFILL_A + PREFILL_C * 32
    assert out.first_ms[0] == pytest.approx(prefill)
    assert out.done_ms[0] == pytest.approx(prefill + 9 * (STEP_A + STEP_C))
    assert out.steps == 9 and out.joins == 1


def test_a_request_joins_between_steps_and_both_share_the_steps() -> None:
    alone = run(arrivals([0.0], [32], [16]))
    both = run(arrivals([0.0, 300.0], [32, 32], [16, 16]))
    # the second row joined while the first decoded: its first token came before the first ended
    assert both.first_ms[1] < both.done_ms[0]
    assert both.joins == 2
    # the first paid the joiner's prefill and wider steps, but far less than a second whole run
    assert alone.done_ms[0] < both.done_ms[0] < alone.done_ms[0] + (both.done_ms[1] - both.first_ms[1])
    assert max(both.step_rows) == 2


def test_rows_leave_as_they_finish_and_the_set_shrinks() -> None:
    out = run(arrivals([0.0, 0.0], [32, 32], [12, 4]))
    assert out.done_ms[1] < out.done_ms[0]
    assert max(out.step_rows) == 2 and out.step_rows[-1] == 1


def test_a_kv_cap_of_one_request_delays_the_next_until_the_first_leaves() -> None:
    arr = arrivals([0.0, 10.0], [32, 32], [16, 16])
    free = run(arr)
    capped = run(arr, LoopSettings(token_cap=32 + NEW, reserve_tokens=NEW))
    assert free.first_ms[1] < free.done_ms[0]
    assert capped.first_ms[1] >= capped.done_ms[0]


def test_a_longer_cache_makes_steps_dearer() -> None:
    attention = GenerationCost.linear(PREFILL_A, PREFILL_C, STEP_A, STEP_C, per_row_token_ms=0.5, ref_cache=32)
    short = run(arrivals([0.0], [32], [16]), cost=attention)
    long = run(arrivals([0.0], [256], [16]), cost=attention)
    assert (long.done_ms[0] - long.first_ms[0]) > 1.5 * (short.done_ms[0] - short.first_ms[0])


def test_a_deadline_stops_the_row() -> None:
    out = run(arrivals([0.0], [32], [64], deadline=500.0, limit=64))
    assert out.expired[0] and out.done_ms[0] <= 500.0 + STEP_A + STEP_C


def test_latency_grows_with_load_and_throughput_follows_it() -> None:
    rng = np.random.default_rng(3)
    n = 150
    prompts = rng.integers(16, 64, n).tolist()
    emits = rng.integers(4, NEW + 1, n).tolist()
    gaps = rng.exponential(1.0, n)
    figures = []
    for rate in (2.0, 6.0, 12.0):
        times = (np.cumsum(gaps) * 1000.0 / rate).tolist()
        arr = arrivals(times, prompts, emits)
        figures.append(gen_figures(run(arr), np.asarray(emits)))
    p99s = [f.p99_ms for f in figures]
    rows = [f.mean_rows for f in figures]
    assert p99s[0] < p99s[1] < p99s[2]
    assert rows[0] < rows[1] < rows[2]
    assert figures[0].throughput_rps < figures[2].throughput_rps


def test_every_request_is_answered_once() -> None:
    rng = np.random.default_rng(5)
    n = 200
    times = np.cumsum(rng.exponential(50.0, n)).tolist()
    arr = arrivals(times, rng.integers(8, 200, n).tolist(), rng.integers(1, NEW + 1, n).tolist(), deadline=3000.0)
    out = run(arr, LoopSettings(token_cap=600, step_budget_ms=80.0, reserve_tokens=NEW), inflight=12)
    assert not np.isnan(out.done_ms).any()
    served = ~out.expired
    assert (out.first_ms[served] <= out.done_ms[served]).all()
    assert (out.dispatch_ms[served] >= arr.create_ms[served]).all()


def test_the_loop_follows_the_consumer() -> None:
    """The simulator runs the consumer's own admission rule and its fused chunked prefill (a chunk
    rides in the decode step's forward pass for RIDE_SHARE of a step)."""
    from consumers.runners import chunked_prefill, decoding, iteration
    from pipeline.core.engine import joins
    from pipeline.core.sim.generation import chunks, decode_loop

    # the names each side imported (vars(): they are not re-exported, so not module attributes to mypy)
    loop, runner, prefill = vars(decode_loop), vars(iteration), vars(chunked_prefill)
    assert loop["JoinRule"] is joins.JoinRule and runner["JoinRule"] is joins.JoinRule
    assert (loop["JOIN_GROUP"], loop["JOIN_WAIT_STEPS"], loop["JOIN_SLOTS"]) == (
        runner["JOIN_GROUP"],
        runner["JOIN_WAIT_STEPS"],
        runner["JOIN_SLOTS"],
    )
    assert decode_loop.DEAD_SHARE == decoding.DEAD_SHARE
    assert prefill["MIN_CHUNK"] is joins.MIN_CHUNK
    assert vars(chunks)["RIDE_SHARE"] == joins.RIDE_SHARE
    # one pacing rule and one spreading rule: the consumer's pacer and the simulator call the same
    assert prefill["paced_ride"] is loop["paced_ride"] is joins.paced_ride
    assert loop["ride_tokens"] is joins.ride_tokens
    assert prefill["ride_plan"] is loop["ride_plan"] is joins.ride_plan
    assert prefill["RideCredit"] is loop["RideCredit"] is joins.RideCredit  # and one spacing rule
    pacer = chunked_prefill.RidePacer(128, tpot_ms=100.0)
    pacer.observe_ride(128, 50.0 * 1.35, 50.0)  # the simulator's ride cost: a chunk adds RIDE_SHARE
    per_token = chunks.ride_token_ms(50.0, 128, 4)
    assert pacer.cost() == pytest.approx((0.0, per_token))
    assert pacer.tokens(4, 50.0) == 2 * 128  # at most twice its largest ride (joins.vouched_ride) ...
    pacer.observe_ride(256, 50.0 + 256 * per_token, 50.0)
    # ... then what the objective's slack pays for
    assert pacer.tokens(4, 50.0) == joins.ride_tokens(124, 50.0, per_token, 100.0) == int(50.0 / per_token)
    plain = chunked_prefill.RidePacer(128)
    plain.observe_ride(128, 50.0 * 1.35, 50.0)
    assert plain.tokens(4, 50.0) == 124  # no objective: within the budget beside the rows
    from pipeline.core.config import ModelConfig

    assert decode_loop.STEP_TOKEN_BUDGET == ModelConfig(name="m").step_token_budget
    for args in ((272, 24, 48), (272, 4, None), (None, 8, 48)):
        assert running_token_cap(*args) == iteration.running_token_cap(*args)


def test_a_long_prompt_rides_the_steps_in_chunks() -> None:
    """A long joiner beside a decoding row: fused chunks cost the row ~1.35 steps each, instead of
    one stall of the whole prefill."""
    arr = arrivals([0.0, 100.0], [32, 1000], [40, 4], limit=64)
    chunked = run(arr, LoopSettings(reserve_tokens=64, step_token_budget=128))
    whole = run(arr, LoopSettings(reserve_tokens=64, step_token_budget=0))
    step = STEP_A + STEP_C
    assert whole.longest_gap_ms >= PREFILL_C * 1000
    assert chunked.longest_gap_ms <= 1.35 * step + 1e-6
    # the prefilled row's first step ends at 104 + 55 ms: the rider joins there (it stalls nobody: no
    # waiting for company, where the one-piece prefill waited JOIN_WAIT_STEPS steps), then 1000
    # tokens at 128 a step: 8 fused steps (the last one a part chunk, paid for its part)
    joined = PREFILL_A + PREFILL_C * 32 + step
    assert chunked.first_ms[1] == pytest.approx(joined + 8 * step + 0.35 * step * 1000 / 128)
    waited = PREFILL_A + PREFILL_C * 32 + JOIN_WAIT_STEPS * step  # JOIN_WAIT_STEPS steps from its arrival (step 0)
    assert whole.first_ms[1] - (PREFILL_A + PREFILL_C * 1000) == pytest.approx(waited)


def test_a_tpot_objective_never_stalls_the_rows() -> None:
    """With a TPOT objective a long prompt rides the steps within the objective's slack, never
    prefilled in one piece while a row decodes (a stall would spend the slack the rides fill)."""
    arr = arrivals([0.0, 2000.0], [32, 3000], [80, 4], limit=80)
    out = run(arr, LoopSettings(reserve_tokens=80, step_token_budget=8, tpot_ms=200.0))
    assert out.longest_gap_ms <= 200.0 + 1e-6
    tpot = (out.done_ms[0] - out.first_ms[0]) / 79
    assert tpot <= 200.0


def test_a_tpot_objective_rides_its_slack() -> None:
    """With a TPOT objective a step carries as many prompt tokens as the objective's slack over the
    plain step pays for, not one budget's chunk: the long prompt starts sooner, and no step of the
    running row takes longer than the objective."""
    arr = arrivals([0.0, 100.0], [32, 1000], [40, 4], limit=64)
    step = STEP_A + STEP_C
    paced = run(arr, LoopSettings(reserve_tokens=64, step_token_budget=128))
    slack = run(arr, LoopSettings(reserve_tokens=64, step_token_budget=128, tpot_ms=4 * step))
    assert slack.first_ms[1] < paced.first_ms[1] - 3 * step
    assert slack.longest_gap_ms <= 4 * step + 1e-6
    # a ridden token adds 0.35 step / 128: 3 steps of slack pay for ~1097 tokens, the whole prompt
    assert slack.longest_gap_ms == pytest.approx(step * (1 + 0.35 * 1000 / 128))


def test_a_ride_with_a_fixed_part_carries_what_the_fixed_part_costs_and_is_spaced_as_the_consumer_spaces_it() -> None:
    """A ride that adds 40 ms whatever it carries plus 1 ms a token beside a 55 ms plain step: the
    simulator rides as the consumer's pacer does once it has fitted both parts (40 tokens, 80 ms
    added) and spaces the rides so that they add RIDE_SHARE of a step on average; without the fixed
    part it would ride 19 tokens every step and miss the 40 ms each time."""
    from consumers.runners.chunked_prefill import RidePacer
    from pipeline.core.engine.joins import RIDE_SHARE, RideCredit, paced_ride
    from pipeline.core.sim.generation.decode_loop import STEP_TOKEN_BUDGET

    step = STEP_A + STEP_C
    fixed, per_token = 40.0, 1.0
    cost = dataclasses.replace(COST, ride_ms_per_token=per_token, ride_fixed_ms=fixed)
    assert cost.ride_fixed() == fixed and cost.scaled(2.0).ride_fixed() == 2 * fixed
    assert dataclasses.replace(cost, ride_measured_ms=1.5).ride_fixed() == 0.0  # a measured pace holds it
    arr = arrivals([0.0, 100.0], [32, 1000], [400, 4], limit=400)
    out = run(arr, LoopSettings(reserve_tokens=400, step_token_budget=STEP_TOKEN_BUDGET), cost=cost)
    tokens = paced_ride(STEP_TOKEN_BUDGET, 1, step, per_token, None, fixed)
    assert tokens == 40
    assert out.longest_gap_ms == pytest.approx(step + fixed + tokens * per_token)
    # the consumer's pacer, fed the simulated rides, fits the same two parts and rides the same size
    pacer = RidePacer(STEP_TOKEN_BUDGET)
    for size in (8, 16, tokens):
        pacer.observe_ride(size, step + fixed + size * per_token, step)
    assert pacer.cost() == pytest.approx((fixed, per_token))
    assert pacer.tokens(1, step) == tokens
    # spaced: one ride in four steps (80 ms owed, 19.25 paid back a step), 25 rides for the 1000 tokens
    credit, rides, steps = RideCredit(), 0, 0
    allowance = RIDE_SHARE * step
    while rides * tokens < 1000:
        steps += 1
        if credit.due(allowance):
            credit.rode(fixed + tokens * per_token, allowance)
            rides += 1
        else:
            credit.plain(allowance)
    assert rides == 25 and steps >= 4 * 24
    first = out.first_ms[1] - 100.0
    assert first >= steps * step + rides * (fixed + tokens * per_token) - 2 * step
    flat = run(arr, LoopSettings(reserve_tokens=400, step_token_budget=STEP_TOKEN_BUDGET), cost=replace_fixed(cost))
    assert flat.longest_gap_ms == pytest.approx(step + int(allowance / per_token) * per_token)


def replace_fixed(cost: GenerationCost) -> GenerationCost:
    return dataclasses.replace(cost, ride_fixed_ms=0.0)


def test_cost_from_profile_curves_reads_the_attention_slope() -> None:
    curves = GenerationCurves(
        prefill=((32, 100.0), (64, 160.0), (128, 230.0), (256, 500.0), (512, 1000.0)),
        steps=((1, 36, 50.0), (2, 36, 60.0), (4, 36, 80.0)),
        long_steps=((1, 260, 50.0 + 224 * 0.1),),
    )
    cost = GenerationCost.from_curves(curves)
    assert cost.per_row_token_ms == pytest.approx(0.1)
    assert cost.step_ms(2, 36) == pytest.approx(60.0)
    assert cost.step_ms(2, 136) == pytest.approx(60.0 + 2 * 100 * 0.1)
    # prefill is a line through the measured prefills: an outlier moves it, it does not make a step
    slope = (cost.prefill_ms(1, 512) - cost.prefill_ms(1, 256)) / 256
    assert (cost.prefill_ms(1, 64) - cost.prefill_ms(1, 32)) / 32 == pytest.approx(slope)
    assert cost.prefill_ms(2, 128) == pytest.approx(cost.prefill_ms(1, 256))
    assert 450.0 < cost.prefill_ms(1, 256) < 550.0


def test_a_hopeless_joiner_is_refused_at_once_once_answer_lengths_are_known() -> None:
    # eight answers of 16 tokens teach the rule; then a long row runs and a joiner arrives whose
    # 16 tokens x a ~55 ms step cannot end within its 500 ms
    times = [0.0] * 8 + [2000.0, 2300.0]
    emits = [16] * 8 + [64, 16]
    arr = GenArrivals(
        create_ms=np.array(times),
        deliver_ms=np.array(times),
        prompt=np.full(10, 32),
        emits=np.array(emits),
        limit=np.array([16] * 8 + [64, 16]),
        priority=np.zeros(10, dtype=int),
        lane=np.zeros(10, dtype=int),
        deadline_ms=np.array([np.nan] * 9 + [2800.0]),
    )
    out = run(arr, LoopSettings(reserve_tokens=4), inflight=4)
    assert not out.expired[:9].any()
    assert out.expired[9] and np.isnan(out.first_ms[9]) and out.done_ms[9] < 2600.0  # refused, not left to expire
    kept = run(arr, LoopSettings(reserve_tokens=4, refuse_hopeless=False), inflight=4)
    assert kept.expired[9] and kept.done_ms[9] == pytest.approx(2800.0, abs=60.0)  # it waited for its deadline


def test_nobody_is_refused_before_answer_lengths_are_known() -> None:
    arr = GenArrivals(
        create_ms=np.array([0.0, 300.0]),
        deliver_ms=np.array([0.0, 300.0]),
        prompt=np.array([32, 32]),
        emits=np.array([64, 4]),
        limit=np.array([64, 16]),
        priority=np.zeros(2, dtype=int),
        lane=np.zeros(2, dtype=int),
        deadline_ms=np.array([600.0, 1000.0]),
    )
    out = run(arr, LoopSettings(reserve_tokens=4), inflight=4)
    # by max_new_tokens (16 x 55 ms) it would be hopeless; its answer of 4 tokens makes it
    assert out.expired[0] and not out.expired[1]


def test_a_joining_prefill_shows_as_the_running_rows_longest_gap() -> None:
    out = run(
        arrivals([0.0] + [200.0] * 4, [32, 400, 400, 400, 400], [30, 4, 4, 4, 4]),
        LoopSettings(reserve_tokens=NEW, step_token_budget=0),
    )
    assert out.longest_gap_ms >= PREFILL_C * 4 * 400  # the group of four, padded, stalled the first row


def test_a_burst_past_the_ttft_objective_gives_up_the_hopeless_and_serves_the_rest_in_time() -> None:
    """Twenty 400-token prompts at once, 1 s to the first token, prefills of ~840 ms: served in
    order, all but the first would be late. With the objective the loop gives up those that no
    order could serve in time (a lower bound: 2 ms a prompt token), and every one it serves is in
    time; more answers meet the objective than without it. Nobody is given up under a light load."""
    ttft = 1000.0
    arr = arrivals([0.0] * 20, [400] * 20, [4] * 20)
    plain = run(arr)
    shed = run(arr, LoopSettings(reserve_tokens=NEW, ttft_ms=ttft))
    served = ~shed.expired
    assert shed.expired.any() and served.any()
    assert ((shed.first_ms - arr.create_ms)[served] <= ttft).all()
    met = lambda out: int(((out.first_ms - arr.create_ms) <= ttft)[~out.expired].sum())  # noqa: E731
    assert met(shed) >= met(plain) and met(plain) < 20
    light = arrivals([k * 2000.0 for k in range(6)], [400] * 6, [4] * 6)
    assert not run(light, LoopSettings(reserve_tokens=NEW, ttft_ms=ttft)).expired.any()


PROFILED = dataclasses.replace(COST, ride_ms_per_token=PREFILL_C, ride_fixed_ms=PREFILL_A)
"""A device whose rides cost what its prefills do (a CPU, as from a profile): 40 ms each plus 2 ms a token."""


def test_at_low_load_a_long_prompt_is_prefilled_in_one_piece_when_the_rows_can_spare_the_stall() -> None:
    """A row decoding 200 tokens under a 100 ms TPOT objective with 55 ms steps has banked seconds when
    a 600-token prompt comes: its one-piece prefill (1.24 s) fits the row's room and comes ~4x sooner
    than rides of 20 tokens every ~180 ms; the row still meets its objective. A 1000-token prompt
    beside a row near its end does not fit: it rides, and the row never stalls."""
    tpot = 100.0
    settings = LoopSettings(reserve_tokens=200, step_token_budget=128, tpot_ms=tpot)
    arr = dataclasses.replace(arrivals([0.0, 3000.0], [32, 600], [200, 4], limit=200), exact_answers=True)
    out = run(arr, settings, cost=PROFILED)
    step = STEP_A + STEP_C
    assert out.first_ms[1] - 3000.0 <= PREFILL_A + PREFILL_C * 600 + step + 1e-6
    assert (out.done_ms[0] - out.first_ms[0]) / 199 <= tpot
    rides = run(arr, dataclasses.replace(settings, tpot_ms=None), cost=PROFILED)  # no objective: no room
    assert rides.first_ms[1] - 3000.0 > 3 * (out.first_ms[1] - 3000.0)
    near_end = dataclasses.replace(arrivals([0.0, 1000.0], [32, 1000], [30, 4], limit=30), exact_answers=True)
    rode = run(near_end, LoopSettings(reserve_tokens=30, step_token_budget=128, tpot_ms=tpot), cost=PROFILED)
    assert rode.longest_gap_ms < 3 * step


def test_a_prompt_late_on_rides_is_prefilled_in_one_piece_when_the_rows_can_spare_it() -> None:
    """A 1000-token prompt joins beside a row about to end (no room: it rides) and a long one. Once the
    short row left, at 20 tokens a ride every ~200 ms it would get its first token after ~10 s, past
    its 3 s objective: the rest is prefilled at once (2 s), which the long row can spare. Without a
    TTFT objective nothing weighs it and it rides to the end."""
    tpot, ttft = 100.0, 3000.0
    arr = dataclasses.replace(arrivals([0.0, 0.0, 150.0], [32, 32, 1000], [3, 200, 4], limit=200), exact_answers=True)
    arr = dataclasses.replace(arr, limit=np.asarray([3, 200, 4]))
    settings = LoopSettings(reserve_tokens=200, step_token_budget=128, tpot_ms=tpot)
    weighed = run(arr, dataclasses.replace(settings, ttft_ms=ttft), cost=PROFILED)
    plain = run(arr, settings, cost=PROFILED)
    assert not weighed.expired.any()
    assert weighed.first_ms[2] - 150.0 <= ttft < plain.first_ms[2] - 150.0
    assert (weighed.done_ms[1] - weighed.first_ms[1]) / 199 <= tpot


def test_the_simulators_rides_grow_as_the_consumers_do_at_most_twice_the_largest_recent_ride() -> None:
    """0.1 ms a ridden token, a 55 ms plain step and a 155 ms objective: the slack pays for 1,000 tokens.
    A 1,200-token prompt alone rides 1,000 tokens, then the rest (the longest gap: a 155 ms step). After
    a 300-token prompt rode whole, the same prompt rides 600 and 600 (joins.vouched_ride): 115 ms."""
    cost = dataclasses.replace(COST, ride_ms_per_token=0.1)
    settings = LoopSettings(reserve_tokens=400, tpot_ms=STEP_A + STEP_C + 100.0)
    alone = run(arrivals([0.0, 1000.0], [32, 1200], [200, 4], limit=400), settings, cost=cost)
    assert alone.longest_gap_ms == pytest.approx(STEP_A + STEP_C + 100.0)
    after = run(arrivals([0.0, 100.0, 1000.0], [32, 300, 1200], [200, 4, 4], limit=400), settings, cost=cost)
    assert after.longest_gap_ms == pytest.approx(STEP_A + STEP_C + 0.1 * 600)
