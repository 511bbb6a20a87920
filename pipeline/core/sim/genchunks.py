"""Chunked prefill as the consumer's decode loop runs it: a chunk rides in the decode step's forward pass.

A group that is not prefilled in one piece (joins.py decides) rides the decode steps: each
step carries a chunk of `step_token_budget` padded prompt tokens in its own forward pass: the
weights are read once, so a step carrying a chunk costs the plain step plus `RIDE_SHARE` of it
(the consumer's fused rule, consumers/runners/chunked_prefill.py: its pacer sizes a chunk to
add that share, within the budget); a group's last, shorter chunk costs its share of that. With no row decoding there
is nothing to stall: the rest of the prompt is prefilled at once. The group's rows join the
running set (their first token) when its last column is in.

Pure: no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.engine.joins import MIN_CHUNK

RIDE_SHARE = 0.35
"""A chunk riding a decode step adds this share of a plain step (the consumer's fused rule)."""


@dataclass(eq=False)
class ChunkedGroup:
    """One group's prefill, a chunk of columns per decode step."""

    rows: list
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

    def ride(self, budget: int, decoding: int) -> int:
        """One chunk rides the next step beside `decoding` rows; returns its padded tokens."""
        start = self.done
        self.done = min(self.width, self.done + max(1, chunk_tokens(budget, decoding) // len(self.rows)))
        return (self.done - start) * len(self.rows)

    def rest_tokens(self) -> int:
        """Padded tokens still to prefill (all at once when no row decodes)."""
        return len(self.rows) * (self.width - self.done)


def chunk_tokens(budget: int, decoding: int) -> int:
    """Padded prompt tokens one chunk carries (the step's token budget; `decoding` rows beside it
    are paid for by the step itself)."""
    return max(budget, MIN_CHUNK)


def ride_ms(step_ms: float, chunks: float = 1.0) -> float:
    """A decode step carrying `chunks` chunks of prompt tokens (a part chunk costs its part)."""
    return step_ms * (1.0 + RIDE_SHARE * chunks)


def rides(tokens: int, budget: int, decoding: int) -> float:
    """Chunks' worth of `tokens` prompt tokens beside `decoding` rows."""
    return tokens / chunk_tokens(budget, decoding)
