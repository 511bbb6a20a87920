"""Who joins a running decode set, and how its prompts are prefilled: the decode loop's admission rule.

One rule for the consumer's decode loop (consumers/runners/iteration.py) and the generation
simulator (pipeline/core/sim/generation/decode_loop.py), so the bench runs the consumer's own decisions:

- hopeless joiners are refused (`cannot_meet_deadline`): one whose answer could not end by its
  deadline at the current time per step. An answer's length is judged by the p75 of the recent
  answers (never over its max_new_tokens): reserving every max_new_tokens refuses requests whose
  typical answer fits easily (with 500 asked, 80 answered and an 8 s deadline, every joiner).
  Before `LEARN_AFTER` answers ended nobody is judged: a refusal needs evidence, and judging by
  max_new_tokens then keeps the running set from ever teaching the rule;
- late for the first token: with a time-to-first-token objective, a waiting request (a joiner, or
  a queued prompt not yet started) whose first token could not come by its record time plus the
  objective even if its prompt and every prompt served before it were prefilled back to back at
  the device's measured price per prompt token (a lower bound: no decode step, no fixed part) is
  answered `expired` at once (`late_for_first_token`): it cannot count, and its prefill would
  make the prompts behind it late too. Serving the hopeless first turned a burst on a CPU into
  minutes of first tokens for everyone (a production trace's busiest minute);
- urgent first: joiners enter by priority (0 first), dispatch order within a level;
- memory: joiners enter while the rows' prompt plus max_new_tokens fit the token cap;
- a join that stalls the running rows (a prefill in one piece) pays when the set is empty,
  `join_group` wait, the set has halved since the last join, or the oldest joiner waited
  `join_wait_steps` steps; a join that rides stalls nobody and pays at once (waiting for company
  only delays its first token); while the last step took longer than the step budget a short
  queue does not join;
- length groups: joiners are prefilled in groups of like prompts, so that left-padding to the
  longest prompt of a group costs at most `MAX_PADDING` x the real tokens (a group that rides
  rides one prompt at a time: a ride is paid per token, so it pays no padding at all);
- rides: while rows decode, a group's prompt rides the decode steps in chunks (in the step's own
  forward pass: no stall, the cheapest prefill); with nobody decoding it is prefilled at once.
  A step carries what adds RIDE_SHARE of a plain step or, with a time-per-output-token
  objective, as many tokens as the objective's slack over the plain step pays for
  (`ride_tokens`): the slack goes to the rides, so no stall is banked against it (an earlier
  stall credit spent the same slack on one-piece prefills, and rows riding through them
  missed the objective). The objective is a ceiling: while the plain step meets it, rides
  never push the steps past it on average (a floor of RIDE_SHARE did, once rides filled every step);
- a ride that costs a fixed part beside its per-token part (the consumer's pacer measures both)
  carries at least as many tokens as the fixed part costs, and `RideCredit` spaces the rides so
  that what they add, averaged over the steps, stays within the allowance: rides of the MIN_CHUNK
  floor every step took ~1.9x a plain step on a 2-core CPU, where the allowance was 1.35x;
- with a TPOT objective a ride is not capped by the step's token budget but by the recent rides
  (`vouched_ride`): at most twice the largest, and no more than its time per token fits in the
  allowance. A pacer's fit to rides of nearly one size, its per-token part near zero, once asked
  for hundreds of tokens in one step, several times the objective (a short answer's p99);
- a ride spends all of its tokens (`ride_plan`): short groups behind the oldest go whole,
  smallest first, within OLDEST_SHARE's complement of the ride, so a short prompt queued behind
  a long one starts decoding; the oldest (the nearest to missing its time to first token, which
  runs from its record) gets the rest, at least OLDEST_SHARE of the ride; what it leaves goes
  to the others oldest first. An earlier plan gave the short groups any share of the ride and
  left the rest of the step empty when the oldest's rest was short: long prompts in a crowd
  waited past the objective; oldest first alone held short prompts behind long documents.

Pure: no clock, no device; every time is an argument.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

JOIN_GROUP = 4
"""Joiners that make a join worth its prefill at once."""
JOIN_WAIT_STEPS = 6
"""Decode steps the oldest joiner may wait for company (about two lone prefills)."""
MAX_PADDING = 1.25
"""A prefill group's padded tokens (rows x its longest prompt) over its real tokens, at most."""
LEARN_AFTER = 8
"""Answers ended before their lengths judge who is hopeless (nobody is, until then)."""
ANSWER_WINDOW = 256
"""Recent answer lengths the p75 is taken over."""
ANSWER_QUANTILE = 0.75
REMAINING_QUANTILE = 0.25
"""How long a decoding row's answer is judged to run when a stall is weighed (`stall_room`): a short
estimate, so that most rows really have the tokens that pay the stall back."""
MIN_CHUNK = 8
"""Prompt tokens a chunk carries at least (the consumer's chunked prefill)."""
RIDE_WINDOW = 16
"""Recent rides that bound the next one's size (`vouched_ride`; the consumer's pacer fits its cost model
to the same window)."""
RIDE_GROWTH = 2.0
"""A ride larger than every recent ride carries at most this many times the largest (the consumer's
pacer, finding rides of one size, tries twice the size)."""
RIDE_SHARE = 0.35
"""Without a time-per-output-token objective, a decode step that carries prompt tokens in its
forward pass may take this share longer than a plain one (docs/runners.md, "Fused chunks")."""
ONE_PIECE_GAIN = 2.0
"""A group is prefilled in one piece beside decoding rows only when that at least halves its wait for
the first token against riding: a stall costs every row at once, where rides spend slack the
time-per-output-token objective grants anyway (with cheap rides, one-piece joins of a few tens of
ms each added up to missed TPOTs in the generation bench's flash-deadline)."""
OLDEST_SHARE = 0.5
"""Share of a ride the oldest queued group gets at least (while its rest is that long): short
groups go whole before it only within the other share, so no prompt waits behind them for ever."""


@dataclass(frozen=True)
class JoinSettings:
    token_cap: int | None = None
    """KV tokens the running set may reserve (prompt + reserved generation per row); None: unbounded."""
    step_budget_ms: float | None = None
    """While the last step took longer, a short queue does not join."""
    join_group: int = JOIN_GROUP
    join_wait_steps: int = JOIN_WAIT_STEPS
    tpot_ms: float | None = None
    """Time-per-output-token objective (the model's slo_ms_per_new_token): rides fill its slack."""
    step_token_budget: int = 0
    """Tokens a ride carries without an objective: a group rides while rows decode (0: never chunked)."""
    refuse_hopeless: bool = True


@dataclass(frozen=True)
class Joiner:
    """What the rule reads of one waiting row."""

    prompt: int
    reserved: int
    """KV tokens it reserves: prompt plus the generation it may reserve."""
    limit: int
    """Its max_new_tokens."""
    deadline_ms: float | None
    priority: int
    arrived_step: int
    """The loop's step count when its batch arrived."""


@dataclass(frozen=True)
class LoopView:
    """What the rule reads of the decode loop."""

    running: int
    """Rows decoding."""
    reserved: int
    """KV tokens the running and prefilling rows reserve."""
    last_step_ms: float
    steps: int
    size_at_join: int


@dataclass(frozen=True)
class Waiting:
    """What `late_for_first_token` reads of one request waiting for its first token."""

    first_token_by_ms: float | None
    """Record time plus the time-to-first-token objective; None: no objective."""
    tokens: int
    """Prompt tokens still to prefill."""
    started: bool
    """Part of its prompt is prefilled already (it is never dropped then: the work is spent)."""


def late_for_first_token(waiting: Sequence[Waiting], now_ms: float, per_token_ms: float | None) -> list[int]:
    """Indices of the waiting requests, in the order the loop serves them, whose first token cannot
    come by `first_token_by_ms` even if their prompt and those served before them (the late ones
    aside) were prefilled back to back at `per_token_ms` a prompt token. None or 0: nobody is judged
    (a price must be measured before a request is given up on)."""
    if not per_token_ms or per_token_ms <= 0:
        return []
    late: list[int] = []
    ahead = 0
    for k, w in enumerate(waiting):
        ahead += w.tokens
        if not w.started and w.first_token_by_ms is not None and now_ms + ahead * per_token_ms > w.first_token_by_ms:
            late.append(k)
            ahead -= w.tokens
    return late


@dataclass(frozen=True)
class Decoding:
    """What `stall_room` reads of one decoding row."""

    first_ms: float
    """When its first token came."""
    emitted: int
    """Tokens it has, the first included."""
    remaining: int
    """Tokens it is judged to generate still (`JoinRule.remaining_tokens`)."""


def stall_room(rows: Sequence[Decoding], now_ms: float, step_ms: float, tpot_ms: float | None) -> tuple[float, float]:
    """(room, banked): how long a prefill in one piece may stall every decoding row now with each
    still meeting the time-per-output-token objective on average, if its remaining tokens take plain
    steps of `step_ms`: the least over the rows of what it has banked (the objective's time for its
    tokens so far less the time they took) plus its remaining tokens' slack over the plain step;
    and the least banked alone (the part of a stall no later step pays back). (0, 0) without an
    objective, a measured step or rows, or while the plain step misses the objective."""
    if not rows or tpot_ms is None or not 0 < step_ms < tpot_ms:
        return 0.0, 0.0
    banks = [tpot_ms * (r.emitted - 1) - (now_ms - r.first_ms) for r in rows]
    room = min(b + r.remaining * (tpot_ms - step_ms) for b, r in zip(banks, rows, strict=True))
    return max(0.0, room), max(0.0, min(banks))


def rides_ms(tokens: int, ride_tokens: int, per_ride_ms: float) -> float:
    """How long `tokens` prompt tokens take to ride at `ride_tokens` a ride, a ride every `per_ride_ms`
    (its step and the plain steps that pay it back)."""
    return -(-tokens // max(1, ride_tokens)) * per_ride_ms


def rides_late(rest_tokens: int, ride_tokens: int, per_ride_ms: float, now_ms: float, by_ms: float | None) -> bool:
    """Whether a queued prompt with `rest_tokens` to prefill, riding at `ride_tokens` a ride every
    `per_ride_ms`, would get its first token past `by_ms` (None: it has no time-to-first-token objective)."""
    return by_ms is not None and ride_tokens > 0 and now_ms + rides_ms(rest_tokens, ride_tokens, per_ride_ms) > by_ms


def length_groups(prompts: Sequence[int]) -> list[list[int]]:
    """Indices of `prompts` in prefill groups of like lengths: sorted by length, a group grows while
    its rows x longest prompt stay within MAX_PADDING x its tokens."""
    order = sorted(range(len(prompts)), key=lambda k: prompts[k])
    groups: list[list[int]] = []
    tokens = 0
    for k in order:
        p = prompts[k]
        if groups and (len(groups[-1]) + 1) * p <= MAX_PADDING * (tokens + p):
            groups[-1].append(k)
            tokens += p
        else:
            groups.append([k])
            tokens = p
    return groups


class JoinRule:
    """The admission rule of one decode loop; it learns answer lengths."""

    def __init__(self, settings: JoinSettings) -> None:
        self.s = settings
        self._answers: deque[int] = deque(maxlen=ANSWER_WINDOW)
        self._expected: int | None = None
        self._short: int | None = None

    def learn(self, tokens: int) -> None:
        """An answer ended with `tokens` generated (not one stopped by its deadline)."""
        self._answers.append(tokens)
        self._expected = self._short = None

    def expected_tokens(self, limit: int) -> int:
        """Tokens a new answer is judged to need: the recent answers' p75, capped at its limit."""
        if len(self._answers) < LEARN_AFTER:
            return limit
        if self._expected is None:
            ranked = sorted(self._answers)
            self._expected = ranked[min(len(ranked) - 1, int(ANSWER_QUANTILE * len(ranked)))]
        return min(limit, self._expected)

    def remaining_tokens(self, emitted: int, limit: int, exact: bool) -> int:
        """Tokens a decoding row is judged to generate still: the rest of its limit when its answer runs
        to it (`exact`: a replayed trace's), else the rest of the recent answers' REMAINING_QUANTILE (a
        short estimate: a stall it would have paid back is a miss); none before answers are known."""
        if exact:
            return max(0, limit - emitted)
        if len(self._answers) < LEARN_AFTER:
            return 0
        if self._short is None:
            ranked = sorted(self._answers)
            self._short = ranked[int(REMAINING_QUANTILE * (len(ranked) - 1))]
        return max(0, min(limit, self._short) - emitted)

    def hopeless(self, joiner: Joiner, view: LoopView, now_ms: float) -> bool:
        """Whether its answer could not end by its deadline at the current time per step."""
        if joiner.deadline_ms is None or not view.running or len(self._answers) < LEARN_AFTER:
            return False
        return now_ms + self.expected_tokens(joiner.limit) * view.last_step_ms > joiner.deadline_ms

    def refused(self, joiners: Sequence[Joiner], view: LoopView, now_ms: float) -> list[int]:
        """Indices of the joiners to refuse now (`cannot_meet_deadline`)."""
        if not self.s.refuse_hopeless:
            return []
        return [k for k, j in enumerate(joiners) if self.hopeless(j, view, now_ms)]

    def admit(self, joiners: Sequence[Joiner], view: LoopView, now_ms: float) -> list[int]:
        """Indices of the joiners to prefill now, urgent first, or none yet. Call `refused` first:
        a hopeless joiner here is skipped (it waits)."""
        s = self.s
        room = None if s.token_cap is None else s.token_cap - view.reserved
        order = sorted(range(len(joiners)), key=lambda k: joiners[k].priority)
        fits: list[int] = []
        for k in order:
            j = joiners[k]
            if self.hopeless(j, view, now_ms):
                continue
            if room is not None:
                if j.reserved > room:
                    if not view.reserved and not fits:
                        fits.append(k)  # longer than the cap (the consumer refuses it at check): it runs alone
                    break
                room -= j.reserved
            fits.append(k)
        if not fits:
            return []
        over_budget = s.step_budget_ms is not None and view.last_step_ms > s.step_budget_ms
        if view.running and over_budget and len(joiners) < s.join_group:
            return []
        oldest = min(joiners[k].arrived_step for k in fits)
        pays = (
            not self.one_piece(view.running)
            or not view.running
            or len(fits) >= s.join_group
            or view.running * 2 <= view.size_at_join
            or view.steps - oldest >= s.join_wait_steps
        )
        return fits if pays else []

    def stall_fits(self, stall_ms: float, room_ms: float, queued: int, rides_ms: float) -> bool:
        """Whether a group is prefilled in one piece although rows decode: while no group is queued to
        ride (a stall would delay their rides, and the prompts behind them), its stall fits the rows'
        room (`stall_room`) and it brings the first token ONE_PIECE_GAIN times sooner than riding would
        (`rides_ms`: its tokens at the rides' pace). A long prompt then gets its first token after its own prefill, not
        after many steps of rides at a fixed part's pace (at low load on a 2-core CPU: 1.7 s against
        4.6-4.9 s), for TPOT its rows can spare."""
        return (
            self.s.step_token_budget > 0
            and not queued
            and 0 < stall_ms <= room_ms
            and ONE_PIECE_GAIN * stall_ms <= rides_ms
        )

    def rescue(self, stall_ms: float, room_ms: float, now_ms: float, by_ms: float | None) -> bool:
        """Whether the oldest queued prompt, whose rides would bring its first token past `by_ms`
        (`rides_late`), has the rest of its prompt prefilled in one piece now: when that brings it in
        time and the stall fits the rows' room (`stall_room`). The time-to-first-token objective
        weighs here against the time per output token: the rows give up slack they can spare."""
        return by_ms is not None and now_ms + stall_ms <= by_ms and 0 < stall_ms <= room_ms

    def one_piece(self, running: int) -> bool:
        """Whether a group is prefilled at once (nobody decodes: nothing to stall; or chunking is
        off) or rides the decode steps in chunks (no stall, and a prompt token costs less than in
        a prefill of its own: such a join is admitted without waiting for company)."""
        return self.s.step_token_budget <= 0 or not running


def _slack(step_ms: float, tpot_ms: float | None) -> float | None:
    """The time-per-output-token objective's slack over a plain step of `step_ms`; None without an
    objective or when the plain step misses it."""
    return tpot_ms - step_ms if tpot_ms and 0 < step_ms < tpot_ms else None


def ride_tokens(paced: float, step_ms: float, per_token_ms: float | None, tpot_ms: float | None) -> int:
    """Prompt tokens the next decode step carries in its forward pass. Without a time-per-output-token
    objective, `paced` (what adds RIDE_SHARE of the plain step, within the step's token budget).
    With one that the plain step (`step_ms`) meets, as many as the objective's slack over it pays
    for at `per_token_ms` a ridden token: a step that still meets the objective costs the rows
    nothing they were promised, a step past it costs every row, and every token ridden now is
    a token a joiner does not wait for. A plain step that misses the objective already: `paced`.
    Never under MIN_CHUNK: the prompt moves."""
    slack = _slack(step_ms, tpot_ms)
    if slack is not None and per_token_ms and per_token_ms > 0:
        paced = slack / per_token_ms
    return int(max(MIN_CHUNK, paced))


def ride_allowance(step_ms: float, tpot_ms: float | None) -> float:
    """Milliseconds riding may add to a decode step, averaged over the steps (`RideCredit`): the
    objective's slack over a plain step of `step_ms` while the plain step meets a time-per-output-token
    objective, RIDE_SHARE of the plain step otherwise."""
    slack = _slack(step_ms, tpot_ms)
    return RIDE_SHARE * step_ms if slack is None else slack


def paced_ride(
    budget: int,
    decoding: int,
    step_ms: float,
    per_token_ms: float,
    tpot_ms: float | None,
    fixed_ms: float = 0.0,
    recent: Sequence[tuple[int, float]] = (),
) -> int:
    """Prompt tokens the next ride carries beside `decoding` rows whose plain step takes `step_ms`,
    when a ride adds `fixed_ms` plus `per_token_ms` a token to the step: what fits in the step's
    allowance (`ride_allowance`) beside the fixed part, but at least as many tokens as the fixed part
    costs (a ride of a few tokens would be mostly fixed cost; `RideCredit` then spaces the rides so
    that the average stays within the allowance); within the step's token budget beside the rows.
    The share of a TPOT objective's slack is not capped by the budget (as in `ride_tokens`): the
    `recent` rides, (tokens, ms added) each, bound it instead (`vouched_ride`). The consumer's
    pacer and the simulator both ride by this. Never under MIN_CHUNK."""
    room = max(budget - decoding, MIN_CHUNK)
    allowance = ride_allowance(step_ms, tpot_ms)
    paced = max((allowance - fixed_ms) / per_token_ms, min(room, fixed_ms / per_token_ms))
    if _slack(step_ms, tpot_ms) is not None:
        return int(max(MIN_CHUNK, vouched_ride(paced, recent, allowance)))
    return int(max(MIN_CHUNK, min(room, paced)))


def vouched_ride(tokens: float, recent: Sequence[tuple[int, float]], allowance_ms: float) -> float:
    """`tokens`, or less when that is more than the `recent` rides, (tokens, ms added) each, vouch
    for: a ride larger than all of them carries at most RIDE_GROWTH x the largest, and only as many
    tokens as fit in `allowance_ms` at the largest's own time per token (its fixed part spread over
    its tokens: when a ride costs a fixed part plus a part per token, no larger ride costs more a
    token, so the bound never overshoots). A cost model fitted to rides of nearly one size can put
    nearly all of their time in the fixed part: its per-token part near zero asked for hundreds of
    tokens, and that one step took several times the objective. No bound before any ride."""
    if not recent:
        return tokens
    size, added = max(recent)
    if tokens <= size:
        return tokens
    bound = RIDE_GROWTH * size
    if added > 0:
        bound = min(bound, allowance_ms * size / added)
    return max(float(size), min(tokens, bound))


class RideCredit:
    """When the next ride may go: what the rides add over their allowance is owed, plain steps pay
    it back, and a ride goes while less than one step's allowance is owed, so the time the rides
    add, averaged over the steps, stays within the allowance (at most one allowance ahead). A ride
    with a fixed part (~55 ms beside a ~63 ms plain step, measured on a 2-core CPU) ridden every
    step at the MIN_CHUNK floor took ~1.9x a plain step; spaced, each ride carries more and the
    rows' time per output token gains the allowance on average. Rides that add what the allowance
    pays for go every step."""

    def __init__(self) -> None:
        self.owed_ms = 0.0

    def due(self, allowance_ms: float) -> bool:
        """Whether the next step, which may add `allowance_ms`, may carry a ride."""
        return self.owed_ms <= 0.0 or self.owed_ms < allowance_ms

    def rode(self, added_ms: float, allowance_ms: float) -> None:
        """A ride added `added_ms` to a step that could add `allowance_ms`."""
        self.owed_ms = max(0.0, self.owed_ms + added_ms - allowance_ms)

    def plain(self, allowance_ms: float) -> None:
        """A step that carried nothing paid back `allowance_ms`."""
        self.owed_ms = max(0.0, self.owed_ms - allowance_ms)

    def stalled(self, stall_ms: float, banked_ms: float) -> None:
        """A prefill in one piece stalled the rows `stall_ms`, of which `banked_ms` they had banked
        (`stall_room`): the rest is owed, paid back by the plain steps' slack before the next ride."""
        self.owed_ms += max(0.0, stall_ms - banked_ms)


def ride_plan(remaining: Sequence[int], tokens: int) -> list[tuple[int, int | None]]:
    """One ride of about `tokens` prompt tokens over the queued groups' `remaining` tokens (oldest
    first): the groups behind the oldest whose whole rest fits go whole, smallest first, within
    (1 - OLDEST_SHARE) of the ride; the oldest gets what is left (never under MIN_CHUNK); what
    it does not need goes to the others, oldest first, while MIN_CHUNK is left. Returns (index,
    tokens) of each riding group in queue order, the oldest first; None: its whole rest."""
    room = tokens - max(MIN_CHUNK, int(OLDEST_SHARE * tokens))
    chunks: dict[int, int] = {}
    for k in sorted(range(1, len(remaining)), key=lambda k: remaining[k]):
        if remaining[k] > room:
            break
        chunks[k] = remaining[k]
        room -= remaining[k]
    left = tokens - sum(chunks.values())
    chunks[0] = min(remaining[0], max(MIN_CHUNK, left))
    left -= chunks[0]
    for k in range(1, len(remaining)):
        if left < MIN_CHUNK:
            break
        if k not in chunks:
            chunks[k] = min(left, remaining[k])
            left -= chunks[k]
    return [(k, None if chunks[k] >= remaining[k] else chunks[k]) for k in sorted(chunks)]
