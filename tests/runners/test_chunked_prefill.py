"""Chunked prefill on tiny real models: the same greedy tokens as a one-piece prefill, interleaved
with the running rows' decode steps under the step token budget."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import cast

import pytest

from consumers.runners import make_runner
from consumers.runners.chunked_prefill import CHUNK_STEP_SHARE, ChunkedPrefill, ChunkPacer, RidePacer, riders
from consumers.runners.decoding import Sequence, decode_all
from consumers.runners.fused_step import ride
from consumers.runners.iteration import IterationScheduler
from consumers.runners.transformers_runner import TransformersRunner
from pipeline.core.config import ConfigError, ModelConfig, parse_config
from pipeline.core.engine.joins import MIN_CHUNK, RIDE_SHARE


def _runner(directory: Path) -> TransformersRunner:
    runner = make_runner(
        ModelConfig(name="g", model_path=str(directory), device="cpu", torch_threads=1, max_new_tokens=40)
    )
    assert isinstance(runner, TransformersRunner)
    runner.load()
    return runner


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def runner(request: pytest.FixtureRequest, tiny_gpt2_dir: Path, tiny_llama_dir: Path) -> TransformersRunner:
    return _runner(tiny_gpt2_dir if request.param == "gpt2" else tiny_llama_dir)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 200) for _ in range(length)]


def _alone(runner: TransformersRunner, prompt: list[int], limit: int) -> list[int]:
    seq = Sequence(list(prompt), limit)
    decode_all(runner._running_set(), [seq])
    return seq.generated


@pytest.mark.model
@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_a_group_prefilled_in_chunks_decodes_what_one_piece_decodes(runner: TransformersRunner, chunk: int) -> None:
    """Left-padded rows of different lengths, fed `chunk` tokens a row at a time, then decoded
    together with a row that was already running: every row's tokens equal its one-piece run."""
    rng = random.Random(chunk)
    prompts = [_prompt(rng, n) for n in (23, 5, 40)]
    early = _prompt(rng, 9)
    running = runner._running_set()
    first = Sequence(list(early), 20)
    running.join([first])
    for _ in range(3):
        running.step()
    group = [Sequence(list(p), 12) for p in prompts]
    prefill = ChunkedPrefill(running, group)
    while not prefill.complete:
        prefill.advance(chunk * len(group))
    assert prefill.chunks == -(-40 // chunk)
    prefill.admit()
    while len(running):
        running.step()
    assert [s.generated for s in group] == [_alone(runner, p, 12) for p in prompts]
    assert first.generated == _alone(runner, early, 20)


@pytest.mark.model
@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_a_group_riding_in_decode_steps_decodes_what_one_piece_decodes(runner: TransformersRunner, chunk: int) -> None:
    """A group of left-padded prompts fed `chunk` tokens a row at a time inside the decode steps
    of running rows of very different widths (one forward pass each): every row's tokens, the
    group's and the running ones', equal its one-piece run alone."""
    rng = random.Random(100 + chunk)
    prompts = [_prompt(rng, n) for n in (23, 5, 40)]
    early = [_prompt(rng, n) for n in (70, 4, 9)]
    running = runner._running_set()
    rows = [Sequence(list(p), 50) for p in early]
    running.join(rows)
    for _ in range(2):
        running.step()
    group = [Sequence(list(p), 12) for p in prompts]
    prefill = ChunkedPrefill(running, group)
    behind = [Sequence(_prompt(rng, n), 12) for n in (6, 3)]
    short = ChunkedPrefill(running, behind)  # queued behind: rides whole in the first step
    rides = 0
    while not prefill.complete:
        if not len(running):  # every row ended (a stop token): the rest is a pass of its own
            prefill.advance(chunk * len(group))
            continue
        _, fed = ride(running, [(prefill, chunk * len(group))] + ([(short, None)] if not rides else []))
        assert fed == len(group) * min(chunk, 40 - (prefill.chunks - 1) * chunk) + (12 if not rides else 0)
        if not rides:
            assert short.complete and short.chunks == 1
            short.admit()
        rides += 1
    assert prefill.chunks == -(-40 // chunk) and rides >= min(prefill.chunks, 3)
    prefill.admit()
    while len(running):
        running.step()
    assert [s.generated for s in group] == [_alone(runner, p, 12) for p in prompts]
    assert [s.generated for s in rows] == [_alone(runner, p, 50) for p in early]
    assert [s.generated for s in behind] == [_alone(runner, s.prompt, 12) for s in behind]


@pytest.mark.model
def test_prompts_riding_side_by_side_in_part_chunks_decode_what_one_piece_decodes(runner: TransformersRunner) -> None:
    """A ride spread over the queue as riders() spreads it: several prompts each fed part of their
    columns in the same decode step (not only the oldest), joining as each completes; every row's
    tokens, the riders' and the running ones', equal its one-piece run alone."""
    rng = random.Random(5)
    early = [_prompt(rng, n) for n in (30, 6)]
    running = runner._running_set()
    rows = [Sequence(list(p), 40) for p in early]
    running.join(rows)
    running.step()
    prompts = [_prompt(rng, n) for n in (10, 37, 5, 26)]
    queue = [ChunkedPrefill(running, [Sequence(list(p), 10)]) for p in prompts]
    group_seqs = [q.seqs[0] for q in queue]
    spread = 0
    while queue and len(running):
        riding = riders(queue, 24)
        spread += sum(1 for prefill, tokens in riding[1:] if tokens is not None)  # a part chunk behind the oldest
        ride(running, riding)
        for prefill, _ in riding:
            if prefill.complete:
                queue.remove(prefill)
                prefill.admit()
    for prefill in queue:  # every running row ended: the rest in passes of their own
        prefill.advance(None)
        prefill.admit()
    while len(running):
        running.step()
    assert spread >= 1
    assert [s.generated for s in group_seqs] == [_alone(runner, p, 10) for p in prompts]
    assert [s.generated for s in rows] == [_alone(runner, p, 40) for p in early]


def _long_joins_a_decoding_row(
    scheduler: IterationScheduler, short: tuple[list[int], int], long: tuple[list[int], int]
) -> dict[str, Sequence]:
    """The short request decodes; after its first step the long one joins; both answered, loop closed."""
    got: dict[str, Sequence] = {}

    def submit(name: str, prompt: list[int], limit: int) -> None:
        (out,) = scheduler.run([Sequence(list(prompt), limit)])
        got[name] = cast(Sequence, out)  # the scheduler was built to hand back its sequences

    first = threading.Thread(target=submit, args=("short", *short))
    first.start()
    deadline = time.monotonic() + 30
    while scheduler.steps < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    submit("long", *long)
    first.join(60)
    scheduler.close()
    return got


@pytest.mark.model
@pytest.mark.parametrize("fused", [True, False])
def test_a_long_prompt_joins_in_chunks_between_the_running_rows_steps(runner: TransformersRunner, fused: bool) -> None:
    """A 60-token prompt joining one decoding row under a small budget: chunks of MIN_CHUNK
    tokens, each riding in a decode step's forward pass (fused) or beside it (not), so it gets
    its first token while that row still decodes; both answers are what they are alone."""
    rng = random.Random(7)
    short_prompt, long_prompt = _prompt(rng, 6), _prompt(rng, 60)
    passes = [0]
    hook = runner._model.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    scheduler = IterationScheduler(runner._running_set, lambda s: s, step_token_budget=4, fused_chunks=fused)  # type: ignore[arg-type, return-value]
    got = _long_joins_a_decoding_row(scheduler, (short_prompt, 40), (long_prompt, 8))
    hook.remove()
    assert scheduler.chunks >= 60 // MIN_CHUNK
    assert passes[0] == scheduler.steps + 1 + (
        0 if fused else scheduler.chunks
    )  # one pass a step, and the short's prefill
    assert got["long"].first_token_ms is not None and got["short"].last_token_ms is not None
    assert got["long"].first_token_ms < got["short"].last_token_ms
    assert got["short"].generated == _alone(runner, short_prompt, 40)
    assert got["long"].generated == _alone(runner, long_prompt, 8)


def test_separate_chunks_are_paced_to_half_a_step_within_the_budget() -> None:
    pacer = ChunkPacer(128)
    assert pacer.tokens(10, 100.0) == 32  # nothing measured yet: a quarter of the budget
    pacer.observe(100, 200.0)  # one size only: 2 ms a token, no fixed part known
    assert pacer.tokens(10, 100.0) == int(CHUNK_STEP_SHARE * 100.0 / 2.0)  # half a 100 ms step: 25 tokens
    assert pacer.tokens(10, 1000.0) == 118  # a slow step: what the budget leaves beside 10 rows
    assert pacer.tokens(10, 5.0) == MIN_CHUNK  # a fast step: the prompt still moves
    pacer = ChunkPacer(128)
    for tokens in (10, 20, 40):
        pacer.observe(tokens, 30.0 + 2.0 * tokens)  # a forward pass costs 30 ms + 2 ms a token
    fixed, per_token = pacer.cost() or (0.0, 0.0)
    assert (fixed, per_token) == pytest.approx((30.0, 2.0))
    assert pacer.tokens(10, 200.0) == int(
        (CHUNK_STEP_SHARE * 200.0 - 30.0) / 2.0
    )  # 35 tokens: 100 ms with the fixed part
    assert pacer.tokens(10, 80.0) == 15  # the fixed part is over half the share: as many tokens as it costs, not fewer


@pytest.mark.model
def test_a_ride_takes_short_groups_whole_within_half_and_spends_the_rest_oldest_first(
    runner: TransformersRunner,
) -> None:
    running = runner._running_set()
    long, a, b, c = (ChunkedPrefill(running, [Sequence([5] * n, 4)]) for n in (500, 30, 10, 80))
    assert riders([long, a, b, c], 64) == [(long, 54), (b, None)]  # a does not fit in the short groups' half
    assert riders([long, c], 64) == [(long, 64)]  # nothing else fits: the oldest gets it all
    assert riders([a, b, c, long], 64) == [(a, None), (b, None), (c, 24)]  # the oldest done: the rest, oldest first
    assert riders([b, a], 64) == [(b, None), (a, None)]


def test_ridden_chunks_add_a_share_of_a_plain_step_from_the_measured_cost_per_token() -> None:
    pacer = RidePacer(128)
    assert pacer.tokens(10, 100.0) == 32  # nothing measured yet: a quarter of the budget
    pacer.observe(500, 1000.0)  # a one-piece prefill: 2 ms a token, until a ride is measured
    assert pacer.tokens(10, 100.0) == int(RIDE_SHARE * 100.0 / 2.0)
    pacer.observe_ride(20, 110.0, 100.0)
    pacer.observe_ride(40, 120.0, 100.0)  # rides: 0.5 ms a token, no fixed part
    assert pacer.cost() == pytest.approx((0.0, 0.5), abs=1e-9, rel=1e-6)
    assert pacer.tokens(10, 100.0) == int(RIDE_SHARE * 100.0 / 0.5)  # 70 tokens add 35 ms to a 100 ms step
    assert pacer.tokens(100, 100.0) == 28  # what the budget leaves beside 100 rows
    assert pacer.tokens(10, 5.0) == MIN_CHUNK  # a fast step: the prompt still moves
    assert pacer.due(100.0)  # no ride added more than its share


def test_rides_with_a_fixed_part_learn_it_carry_more_and_go_less_often() -> None:
    """A ride that costs 40 ms whatever it carries plus 1 ms a token beside a 100 ms plain step:
    rides of one size cannot separate the two, so the pacer tries another size; then it rides what
    the fixed part costs (40 tokens, 80 ms) and waits until plain steps paid back the 45 ms over
    RIDE_SHARE, so the rows' time per output token gains 35 ms a step on average, not 48-80."""
    pacer = RidePacer(128)
    pacer.observe_ride(8, 148.0, 100.0)  # one size: all per token (6 ms a token) ...
    assert pacer.cost() == pytest.approx((0.0, 6.0))
    assert pacer.tokens(10, 100.0) == 16  # ... so the next ride tries twice the size
    pacer.observe_ride(16, 156.0, 100.0)
    assert pacer.cost() == pytest.approx((40.0, 1.0))
    assert pacer.tokens(10, 100.0) == 40
    pacer = RidePacer(128)
    for tokens in (8, 16):
        pacer.observe_ride(tokens, 140.0 + tokens, 100.0)
    for _ in range(3):
        pacer.observe_plain(100.0)
    assert pacer.due(100.0)
    added, rides = 0.0, 0
    for _ in range(40):
        if pacer.due(100.0):
            tokens = pacer.tokens(10, 100.0)
            assert 39 <= tokens <= 40  # the fit's rounding
            added += 40.0 + tokens
            rides += 1
            pacer.observe_ride(tokens, 140.0 + tokens, 100.0)
        else:
            pacer.observe_plain(100.0)
    share = RIDE_SHARE * 100.0
    assert added <= 40 * share + 80.0  # at most one ride ahead of the share
    assert added >= 40 * share - 80.0  # the share is spent, not left idle
    assert 15 <= rides <= 20  # one ride in about every 2.3 steps


def test_with_a_tpot_objective_noisy_rides_of_one_size_never_ask_for_a_step_far_past_it() -> None:
    """Rides that cost 80 ms plus 3 ms a token beside a 61 ms plain step, each step 10% off at random,
    with a 307 ms objective: fitted to the last rides, of nearly one size, the fixed and per-token
    parts now and then came out as almost all fixed, and the pacer asked for thousands of tokens in
    one step. Bounded by what the recent rides vouch for, no step takes 1.5x the objective and the
    rides stay near the 56 tokens the slack pays for."""
    rng = random.Random(3)
    tpot, plain_ms = 307.0, 61.0
    pacer = RidePacer(128, tpot_ms=tpot)
    pacer.observe(128, 460.0)
    last, sizes, slow = plain_ms, [], 0
    for _ in range(3000):
        plain = plain_ms * rng.lognormvariate(0.0, 0.1)
        if not pacer.due(last):
            pacer.observe_plain(plain)
            last = plain
            continue
        tokens = pacer.tokens(10, last)
        ms = plain + (80.0 + 3.0 * tokens) * rng.lognormvariate(0.0, 0.1)
        pacer.observe_ride(tokens, ms, last)
        sizes.append(tokens)
        slow += ms > 1.5 * tpot
    assert slow == 0
    assert max(sizes) <= 2 * 56 and 40 <= sorted(sizes)[len(sizes) // 2] <= 60


@pytest.mark.model
def test_a_ride_waits_while_the_last_rides_are_paid_back(runner: TransformersRunner) -> None:
    """While the pacer's credit is owed, a long prompt does not ride: the row decodes alone and the
    prompt is prefilled once the set is empty."""
    rng = random.Random(11)
    short_prompt, long_prompt = _prompt(rng, 6), _prompt(rng, 40)
    scheduler = IterationScheduler(runner._running_set, lambda s: s, step_token_budget=4, fused_chunks=True)  # type: ignore[arg-type, return-value]
    pacer = scheduler._pacer
    assert isinstance(pacer, RidePacer)
    pacer.observe_ride(8, 1e9, 1.0)  # owes far more than a test's plain steps pay back
    got = _long_joins_a_decoding_row(scheduler, (short_prompt, 30), (long_prompt, 4))
    assert scheduler.chunks == 1  # one piece, once the short row was done
    assert got["long"].first_token_ms is not None and got["short"].last_token_ms is not None
    assert got["long"].first_token_ms >= got["short"].last_token_ms
    assert got["long"].generated == _alone(runner, long_prompt, 4)


def test_a_negative_step_token_budget_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="step_token_budget"):
        parse_config({"models": {"g": {"step_token_budget": -1}}})
    assert parse_config({"models": {"g": {"step_token_budget": 0}}}).models["g"].step_token_budget == 0


@pytest.mark.model
def test_the_model_config_budget_reaches_the_decode_loop(tiny_gpt2_dir: Path) -> None:
    runner = make_runner(
        ModelConfig(name="g", model_path=str(tiny_gpt2_dir), device="cpu", batching="iteration", step_token_budget=7)
    )
    assert isinstance(runner, TransformersRunner)
    runner.load()
    try:
        assert runner.iteration is not None and runner.iteration.step_token_budget == 7
        assert runner.iteration.fused_chunks
    finally:
        runner.close()
    config = ModelConfig(
        name="g", model_path=str(tiny_gpt2_dir), device="cpu", batching="iteration", fused_chunks=False
    )
    runner = make_runner(config)
    assert isinstance(runner, TransformersRunner)
    runner.load()
    try:
        assert runner.iteration is not None and not runner.iteration.fused_chunks
    finally:
        runner.close()
