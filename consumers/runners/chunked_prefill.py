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

How many tokens a step may spend is the model's `step_token_budget`: the
running rows' decode tokens plus the chunk's (the chunk never gets less
than a quarter of the budget, so a long prompt always moves). With nobody
running there is nothing to stall, and the rest is prefilled at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .decoding import RunningSet, Sequence, prompt_tensors

if TYPE_CHECKING:
    import torch

MIN_CHUNK_SHARE = 4
"""A chunk gets at least budget / this tokens, however many rows are decoding."""


def chunk_tokens(budget: int, decoding_rows: int) -> int:
    """Prompt tokens one step may prefill next to `decoding_rows` decode tokens."""
    return max(budget - decoding_rows, max(1, budget // MIN_CHUNK_SHARE))


def needs_chunks(seqs: list[Sequence], budget: int, decoding_rows: int) -> bool:
    """Whether prefilling `seqs` in one piece would spend more than one step's budget."""
    if budget <= 0 or decoding_rows == 0:
        return False
    return len(seqs) * max(len(s.prompt) for s in seqs) > chunk_tokens(budget, decoding_rows)


def split_long(seqs: list[Sequence], budget: int) -> list[list[Sequence]]:
    """Prefill groups for joiners admitted together: a prompt longer than the budget is prefilled
    alone (in one group, every short prompt would be left-padded to its width and prefilled as
    padding), the short ones together."""
    if budget <= 0:
        return [seqs]
    short = [s for s in seqs if len(s.prompt) <= budget]
    return ([short] if short else []) + [[s] for s in seqs if len(s.prompt) > budget]


class ChunkedPrefill:
    """The prefill of one group of joiners, advanced a chunk of columns at a time."""

    def __init__(self, running: RunningSet, seqs: list[Sequence]) -> None:
        self.running = running
        self.seqs = seqs
        self._ids, self._mask = prompt_tensors(seqs, running.pad_id, running.device)
        self._positions = (self._mask.cumsum(-1) - 1).clamp(min=0)
        self._done = 0
        self._cache: Any = None
        self._first: "torch.Tensor | None" = None
        self.chunks = 0
        """Forward passes run so far."""

    @property
    def width(self) -> int:
        return int(self._ids.shape[1])

    @property
    def complete(self) -> bool:
        return self._done >= self.width

    @property
    def reserved_tokens(self) -> int:
        return sum(s.reserved_tokens for s in self.seqs)

    def advance(self, tokens: int | None) -> None:
        """Prefill the next columns, about `tokens` tokens over the group's rows (None: all the rest)."""
        if self.complete:
            return
        rows = len(self.seqs)
        columns = self.width - self._done if tokens is None else max(1, tokens // rows)
        end = min(self.width, self._done + columns)
        out = self.running.model(
            input_ids=self._ids[:, self._done : end],
            attention_mask=self._mask[:, :end],
            position_ids=self._positions[:, self._done : end],
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache = out.past_key_values
        self._done = end
        self.chunks += 1
        if self.complete:
            self._first = out.logits[:, -1, :].argmax(-1)

    def admit(self) -> list[Sequence]:
        """Merge the prefilled rows into the running set; returns those finished by their first token."""
        assert self.complete and self._first is not None
        return self.running.admit(self.seqs, self._cache, self._mask, self._first)
