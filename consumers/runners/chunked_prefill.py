"""Chunked prefill: a joining prompt is prefilled a slice of columns at a time, between decode steps.

A prefill in one piece stalls every running row for its whole duration: a
512-token prompt costs SmolLM2 on one CPU thread about as much as a dozen
decode steps of a running set, so every row's time per output token jumps
while it runs. Here the joiners' left-padded prompts are fed to the model
a few columns per decode step (their own KV cache grows chunk by chunk,
with the attention mask of every column so far and each row's own
positions), and once the last column is in, the rows are merged into the
running set exactly as a one-piece prefill would merge them: the same
cache, the same first token, so greedy outputs do not change.

A group is chunked when its prefill would spend more than the model's
`step_token_budget` leaves beside the decoding rows (one token each). A
chunk is paced by time: it gets what fits beside a decode step in half of
that step's time, from the measured cost of a prefill token (so the rows'
time per output token stays within ~1.5x while a long prompt joins, on any
device), never more than the budget leaves and never under MIN_CHUNK
tokens, so the prompt always moves. With nobody decoding there is nothing
to stall, and the rest is prefilled at once.

With `fused_chunks` a chunk is not a forward pass of its own: it rides in
the decode step's (`fused_step`), paced by `RidePacer` so that the rides add
RIDE_SHARE of a plain step on average, or with a time-per-output-token
objective fill the objective's slack over the plain step; `ChunkPacer`
paces the separate passes.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from pipeline.core.engine.joins import (
    MIN_CHUNK,
    RIDE_WINDOW,
    RideCredit,
    paced_ride,
    ride_allowance,
    ride_plan,
    vouched_ride,
)

from .decoding import RunningSet, Sequence, prompt_tensors

if TYPE_CHECKING:
    import torch

CHUNK_STEP_SHARE = 0.5
"""A step that carries a chunk may take this share longer than a plain decode step: the running
rows' time per output token stays within 1.5x while a long prompt joins."""
PACE_WINDOW = 16
"""Recent prefills (sizes and times) the pacer fits its cost model to."""


class ChunkPacer:
    """How many prompt tokens the next chunk gets.

    A chunk is a forward pass of its own: it costs a fixed part (on a CPU
    about a decode step of a few rows) plus a part per token, both fitted to
    the recent prefills and chunks. It gets what fits beside a decode step in
    CHUNK_STEP_SHARE of that step's time; when the fixed part alone takes
    more than half of that, it gets as many tokens as the fixed part costs
    (tiny chunks would be mostly overhead and multiply it). Never more than
    the step's token budget leaves beside the decoding rows, never under
    MIN_CHUNK.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._seen: deque[tuple[int, float]] = deque(maxlen=PACE_WINDOW)

    def observe(self, tokens: int, ms: float) -> None:
        """A prefill (or chunk) of `tokens` took `ms`."""
        if tokens > 0 and ms > 0:
            self._seen.append((tokens, ms))

    def cost(self) -> tuple[float, float] | None:
        """(fixed ms per forward pass, ms per prompt token) of the recent prefills; None before any."""
        return fit_cost(self._seen)

    def tokens(self, decoding_rows: int, step_ms: float) -> int:
        """Prompt tokens for the next chunk beside `decoding_rows` rows whose last step took `step_ms`."""
        room = max(self.budget - decoding_rows, MIN_CHUNK)
        cost = self.cost()
        if cost is None or step_ms <= 0:
            return max(MIN_CHUNK, min(room, self.budget // 4))
        fixed, per_token = cost
        paced = max(CHUNK_STEP_SHARE * step_ms - fixed, fixed) / per_token
        return int(max(MIN_CHUNK, min(room, paced)))


class RidePacer:
    """How many prompt tokens ride in the next decode step (`fused_step`), and when.

    A ride adds to its step a fixed part and a part per token. The fixed
    part is not small on a CPU: riding the MIN_CHUNK floor of 8 tokens took
    a median 1.89x a ~63 ms plain step of SmolLM2 (2 cores, inside the
    consumer), where a per-token model asked for 3 tokens a step. Both parts
    are fitted to the recent rides (the step's time over the last plain
    step's); rides of one size cannot tell them apart, so while every recent
    ride had the same size the next one rides twice as many (or half, at the
    budget or past what the recent rides vouch for). Before any ride, a one-piece prefill's time per token stands
    in. The size is joins.paced_ride's (at least what the fixed part costs,
    within the step's token budget beside the rows or, with a TPOT objective,
    within what the recent rides vouch for: a fit to rides of nearly one size
    is not trusted far past them), the spacing
    joins.RideCredit's: what the rides add over joins.ride_allowance
    (RIDE_SHARE of a plain step, or a time-per-output-token objective's
    slack over it) is paid back by plain steps, and a ride goes while less
    than one step's allowance is owed.
    """

    def __init__(self, budget: int, tpot_ms: float | None = None) -> None:
        self.budget = budget
        self.tpot_ms = tpot_ms
        self._prefills: deque[tuple[int, float]] = deque(maxlen=PACE_WINDOW)
        self._rides: deque[tuple[int, float]] = deque(maxlen=RIDE_WINDOW)
        self._credit = RideCredit()

    def observe(self, tokens: int, ms: float) -> None:
        """A one-piece prefill of `tokens` took `ms` (an upper bound of a ridden token's cost)."""
        if tokens > 0 and ms > 0:
            self._prefills.append((tokens, ms))

    def observe_ride(self, tokens: int, ms: float, plain_ms: float) -> None:
        """A step that carried `tokens` took `ms` where a plain step took `plain_ms`."""
        if tokens > 0 and plain_ms > 0:
            added = max(ms - plain_ms, 0.0)
            self._rides.append((tokens, added))
            self._credit.rode(added, ride_allowance(plain_ms, self.tpot_ms))

    def observe_plain(self, ms: float) -> None:
        """A step that carried no prompt tokens took `ms`: it pays back what the last rides added."""
        self._credit.plain(ride_allowance(ms, self.tpot_ms))

    def due(self, step_ms: float) -> bool:
        """Whether the next step, whose plain part takes about `step_ms`, may carry a ride."""
        return self._credit.due(ride_allowance(step_ms, self.tpot_ms))

    @property
    def owed_ms(self) -> float:
        """What the last rides and stalls added that plain steps have not paid back yet."""
        return self._credit.owed_ms

    def stalled(self, ms: float, banked_ms: float) -> None:
        """A prefill in one piece stalled the decoding rows `ms`, `banked_ms` of it banked (joins.stall_room)."""
        self._credit.stalled(ms, banked_ms)

    def stall_ms(self, tokens: int) -> float | None:
        """What a one-piece prefill of `tokens` padded tokens is expected to take (the recent one-piece
        prefills' fixed and per-token parts); None before any."""
        cost = fit_cost(self._prefills)
        return None if cost is None else cost[0] + cost[1] * tokens

    def ride_pace(self, decoding_rows: int, step_ms: float, share: float = 1.0) -> tuple[int, float] | None:
        """(prompt tokens, ms) a queued prompt gets per ride at the current pace: its `share` of the
        next ride's size, and the time from one ride to the next (the ride's step and the plain steps
        that pay it back, joins.RideCredit); None before a ride's cost is known."""
        cost = self.cost()
        if cost is None or cost[1] <= 0 or step_ms <= 0:
            return None
        tokens = self.tokens(decoding_rows, step_ms)
        added = cost[0] + cost[1] * tokens
        allowance = ride_allowance(step_ms, self.tpot_ms)
        per_ride = step_ms * max(1.0, added / allowance) + added if allowance > 0 else step_ms + added
        return max(MIN_CHUNK, int(share * tokens)), per_ride

    def cost(self) -> tuple[float, float] | None:
        """(fixed ms, ms per prompt token) a ride adds to a step, from the recent rides; a one-piece
        prefill's time per token before any; None before either."""
        if self._rides:
            return fit_cost(self._rides)
        if self._prefills:
            return 0.0, sum(ms for _, ms in self._prefills) / sum(t for t, _ in self._prefills)
        return None

    def tokens(self, decoding_rows: int, step_ms: float) -> int:
        """Prompt tokens to ride beside `decoding_rows` rows whose last plain step took `step_ms`."""
        room = max(self.budget - decoding_rows, MIN_CHUNK)
        cost = self.cost()
        if cost is None or cost[1] <= 0 or step_ms <= 0:
            return max(MIN_CHUNK, min(room, self.budget // 4))
        fixed, per_token = cost
        tokens = paced_ride(self.budget, decoding_rows, step_ms, per_token, self.tpot_ms, fixed, self._rides)
        sizes = {t for t, _ in self._rides}
        if len(sizes) == 1:
            (size,) = sizes
            if tokens == size:
                tokens = 2 * size if self._may_grow(2 * size, room, step_ms) else max(MIN_CHUNK, size // 2)
        return tokens

    def _may_grow(self, tokens: int, room: int, step_ms: float) -> bool:
        """Whether rides of one size may try `tokens`: within the budget beside the rows and, with a TPOT
        objective the plain step meets, within what the recent rides vouch for (joins.vouched_ride; trying
        twice a ride whose step was near the objective put a step far past it)."""
        if tokens > room:
            return False
        if self.tpot_ms is None or step_ms >= self.tpot_ms:
            return True
        return vouched_ride(tokens, self._rides, ride_allowance(step_ms, self.tpot_ms)) >= tokens


def fit_cost(seen: deque[tuple[int, float]]) -> tuple[float, float] | None:
    """(fixed ms, ms per token) of passes of (tokens, ms), fitted by least squares; all per token when
    their sizes do not vary or the fit has no positive slope and fixed part; None before any."""
    if not seen:
        return None
    xs = [float(t) for t, _ in seen]
    ys = [ms for _, ms in seen]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var > 0 else 0.0
    if slope <= 0 or mean_y - slope * mean_x < 0:
        return 0.0, sum(ys) / sum(xs)
    return mean_y - slope * mean_x, slope


def riders(prefills: list[ChunkedPrefill], tokens: int) -> list[tuple[ChunkedPrefill, int | None]]:
    """The chunks of one ride of about `tokens` tokens, the oldest first (joins.ride_plan: short
    groups whole within half the ride, the oldest at least the other half, the rest oldest first;
    None: its whole rest)."""
    return [(prefills[k], chunk) for k, chunk in ride_plan([p.remaining_tokens for p in prefills], tokens)]


class ChunkedPrefill:
    """The prefill of one group of joiners, advanced a chunk of columns at a time."""

    def __init__(self, running: RunningSet, seqs: list[Sequence]) -> None:
        self.running = running
        self.seqs = seqs
        self.ids, self.mask = prompt_tensors(seqs, running.pad_id, running.device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self._done = 0
        self.cache: Any = None
        """The group's own KV cache so far (None before the first chunk)."""
        self._first: torch.Tensor | None = None
        self.chunks = 0
        """Forward passes (own or ridden) run so far."""

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    @property
    def complete(self) -> bool:
        return self._done >= self.width

    @property
    def reserved_tokens(self) -> int:
        return sum(s.reserved_tokens for s in self.seqs)

    @property
    def remaining_tokens(self) -> int:
        """Tokens (padding included) still to feed."""
        return len(self.seqs) * (self.width - self._done)

    def span(self, tokens: int | None) -> tuple[int, int]:
        """The columns `[start, end)` of the next chunk: about `tokens` tokens over the group's rows
        (None: all the rest)."""
        rows = len(self.seqs)
        columns = self.width - self._done if tokens is None else max(1, tokens // rows)
        return self._done, min(self.width, self._done + columns)

    def fed(self, end: int, cache: Any, first: torch.Tensor | None) -> None:
        """Columns up to `end` are in `cache`; `first`: the group's first tokens, at the last chunk."""
        self.cache, self._done, self._first = cache, end, first
        self.chunks += 1

    def advance(self, tokens: int | None) -> int:
        """Prefill the next columns in a forward pass of their own, about `tokens` tokens over the
        group's rows (None: all the rest); returns the tokens fed (padding included: it costs the same)."""
        if self.complete:
            return 0
        start, end = self.span(tokens)
        out = self.running.model(
            input_ids=self.ids[:, start:end],
            attention_mask=self.mask[:, :end],
            position_ids=self.positions[:, start:end],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.fed(end, out.past_key_values, out.logits[:, -1, :].argmax(-1) if end >= self.width else None)
        if str(self.running.device).startswith("cuda"):
            import torch

            torch.cuda.synchronize()  # the pacer times the chunk: wait for it, not for its launch
        return len(self.seqs) * (end - start)

    def admit(self) -> list[Sequence]:
        """Merge the prefilled rows into the running set; returns those finished by their first token."""
        assert self.complete and self._first is not None
        return self.running.admit(self.seqs, self.cache, self.mask, self._first)
