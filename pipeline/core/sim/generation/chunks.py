"""Chunked prefill as the consumer's decode loop runs it: a chunk rides in the decode step's forward pass.

A group that is not prefilled in one piece (joins.py decides) rides the decode steps in their
own forward pass: the weights are read once, so a chunk of `step_token_budget` padded prompt
tokens costs the plain step plus `RIDE_SHARE` of it, a part chunk its part. A step carries a
chunk, or with a time-per-output-token objective as many tokens as the objective's slack over
the plain step pays for (joins.ride_tokens, the consumer's pacer:
consumers/runners/chunked_prefill.py), over the queued groups as the consumer spreads them
(joins.ride_plan); a ride that adds more than that waits, as the consumer's does, until plain
steps paid it back (joins.RideCredit). With no row decoding there
is nothing to stall: the rest of the prompt is prefilled at once. The group's rows join the
running set (their first token) when its last column is in.

Pure: no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pipeline.core.engine.joins import MIN_CHUNK, RIDE_SHARE


class _Reserving(Protocol):
    @property
    def reserved(self) -> int: ...


RowT = TypeVar("RowT", bound=_Reserving)


@dataclass(eq=False)
class ChunkedGroup(Generic[RowT]):
    """One group's prefill, a chunk of columns per decode step."""

    rows: list[RowT]
    width: int
    """Its longest prompt: every row is left-padded to it."""
    done: int = 0
    """Columns prefilled so far."""

    @property
    def complete(self) -> bool:
        return self.done >= self.width

    @property
    def tokens(self) -> int:
        """Padded prompt tokens of the whole group."""
        return len(self.rows) * self.width

    @property
    def reserved(self) -> int:
        return sum(r.reserved for r in self.rows)

    def ride(self, tokens: int | None) -> int:
        """About `tokens` padded tokens (None: all the rest) ride the next step; returns those fed."""
        start = self.done
        columns = self.width - self.done if tokens is None else max(1, tokens // len(self.rows))
        self.done = min(self.width, self.done + columns)
        return (self.done - start) * len(self.rows)

    def rest_tokens(self) -> int:
        """Padded tokens still to prefill (all at once when no row decodes)."""
        return len(self.rows) * (self.width - self.done)


def chunk_tokens(budget: int, decoding: int) -> int:
    """Padded prompt tokens one chunk carries (the step's token budget; `decoding` rows beside it
    are paid for by the step itself)."""
    return max(budget, MIN_CHUNK)


def ride_token_ms(step_ms: float, budget: int, decoding: int) -> float:
    """What one ridden prompt token adds to a plain step of `step_ms` (the runner's measured cost:
    a chunk adds RIDE_SHARE of the step); the consumer's pacer measures it."""
    return RIDE_SHARE * step_ms / chunk_tokens(budget, decoding)


def ride_ms(step_ms: float, chunks: float = 1.0) -> float:
    """A decode step carrying `chunks` chunks of prompt tokens (a part chunk costs its part)."""
    return step_ms * (1.0 + RIDE_SHARE * chunks)


def rides(tokens: int, budget: int, decoding: int) -> float:
    """Chunks' worth of `tokens` prompt tokens beside `decoding` rows."""
    return tokens / chunk_tokens(budget, decoding)
