"""Greedy decoding over a running set of sequences that can grow and shrink between steps.

`generate()` keeps every row until the longest request ends and cannot take
new rows; serving needs both. A `RunningSet` holds one KV cache for all its
rows (left-padded, with an attention mask and per-row positions): `join()`
prefills a group of new prompts and merges its cache into the running one,
`step()` decodes one token for every row. Static batching is `join()` once,
then `step()` until empty; iteration-level batching joins between steps.

A row that finished (EOS unless it asked to ignore it, its own `max_new_tokens`, or its deadline passed:
`expire()`) is answered at once but its cache row stays: taking rows out
copies the whole cache, so a joiner takes a done row's place (or a spare row
of the buffers, `kv_slack`), the set is compacted only once a share of its
rows are done and nobody took them, and a done row costs only its share of a
step until then.

Works with transformers' `DynamicCache` of full-attention layers (GPT-2,
Llama, ...); a model whose cache is of another kind is refused at the first
join with a clear error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class Sequence:
    """One request inside a running set."""

    prompt: list[int]
    limit: int
    """Tokens this request may generate (its max_new_tokens)."""
    tag: Any = None
    """Whatever the caller needs to route the result back."""
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    reserve: int | None = None
    """Tokens to reserve for generation in the KV cap (None: `limit`): the model's whole
    max_new_tokens keeps the row count at what the profile measured whatever the mix."""
    first_token_ms: float | None = None
    """Epoch ms when the prefill that produced the first token ended."""
    last_token_ms: float | None = None
    """Epoch ms when the step that finished this sequence ended."""
    deadline_ms: float | None = None
    """Epoch ms past which its answer is worthless: `expire()` stops it there."""
    expired: bool = False
    """Stopped by its deadline, not by EOS or its limit."""
    priority: int = 0
    """Client priority, 0 the most urgent: urgent joiners enter the running set first."""
    refused: str | None = None
    """Why the decode loop refused it before its prefill (`cannot_meet_deadline`), if it did."""
    first_token_by_ms: float | None = None
    """Epoch ms past which its first token is of no use (Request.first_token_deadline_ms): a decode
    loop gives it up before its prefill when it cannot be met (joins.late_for_first_token)."""
    ignore_eos: bool = False
    """Generate all `limit` tokens: an end-of-sequence token is kept as a token and decoding goes on
    (GenerationParams.ignore_eos: a replayed trace's answer has the trace's length)."""

    @property
    def reserved_tokens(self) -> int:
        """KV tokens this sequence holds at most: prompt plus every token it may generate."""
        return len(self.prompt) + (self.limit if self.reserve is None else max(self.reserve, self.limit))


DEAD_SHARE = 0.125
"""Compact the cache once this share of its rows are done (about what a copy of it costs in steps)."""


class UnsupportedCache(RuntimeError):
    """The model's KV cache is not a list of plain dynamic layers: rows cannot be merged."""


class RunningSet:
    """Rows decoding together on one device, one token per `step()`."""

    def __init__(self, model: Any, device: str, pad_id: int, stop_ids: frozenset[int]) -> None:
        self.model = model
        self.device = device
        self.pad_id = pad_id
        self.stop_ids = stop_ids
        self.rows: list[Sequence] = []
        """Every cache row in order, done ones included until the next compaction."""
        self._live = 0
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._last: torch.Tensor | None = None
        """The token each row decodes from next (its latest, not yet in the cache)."""

    def __len__(self) -> int:
        """Rows still generating."""
        return self._live

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.rows if not s.finished]

    @property
    def reserved_tokens(self) -> int:
        return sum(s.reserved_tokens for s in self.rows if not s.finished)

    @property
    def cache_tokens(self) -> int:
        """Width of the shared cache (longest row, padding included)."""
        return 0 if self._mask is None else int(self._mask.shape[1])

    def join(self, seqs: list[Sequence]) -> list[Sequence]:
        """Prefill `seqs` and merge them in; returns those already finished by their first token."""
        if not seqs:
            return []
        ids, mask = prompt_tensors(seqs, self.pad_id, self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        return self.admit(seqs, out.past_key_values, mask, out.logits[:, -1, :].argmax(-1))

    def admit(self, seqs: list[Sequence], cache: Any, mask: torch.Tensor, first: torch.Tensor) -> list[Sequence]:
        """Merge prefilled rows in (their cache, left-padded mask and first tokens, however the
        prefill was run: in one piece or in chunks); returns those finished by their first token."""
        _check_cache(cache)
        width = int(mask.shape[1])
        stamp = time.time() * 1000.0
        for s in seqs:
            s.first_token_ms = stamp
        positions = self._place(cache, mask, first, seqs) if self._cache is not None else None
        if positions is None:
            self._compact()
            offset = len(self.rows)
            if self._cache is None:
                from .kv_slack import SlackLayer

                for i, layer in enumerate(cache.layers):
                    cache.layers[i] = SlackLayer.stacked([(layer.keys, layer.values)], width)
                self._cache, self._mask, self._last = cache, mask, first
                self.rows = list(seqs)
            else:
                self._merge(cache, mask, first, seqs)
            positions = list(range(offset, offset + len(seqs)))
        self._live += len(seqs)
        return self._accept(first, positions)

    def _place(self, cache: Any, mask: torch.Tensor, first: torch.Tensor, seqs: list[Sequence]) -> list[int] | None:
        """Write joiners into free rows of the running buffers (finished rows first, then spare
        ones): no copy of the running cache. None when rows or columns run out."""
        import torch

        assert self._mask is not None and self._last is not None
        self._trim()
        layers = self._cache.layers
        free = [i for i, s in enumerate(self.rows) if s.finished][: len(seqs)]
        extra = len(seqs) - len(free)
        width = max(self._mask.shape[1], mask.shape[1])
        if extra > layers[0].free_rows or not layers[0].can_widen(width):
            return None
        positions = free + list(range(len(self.rows), len(self.rows) + extra))
        index = torch.tensor(positions, dtype=torch.long, device=self._mask.device)
        if width > self._mask.shape[1]:
            for layer in layers:
                layer.widen(width)
            self._mask = _pad_left(self._mask, width)
        for layer, theirs in zip(layers, cache.layers, strict=True):
            layer.place(index, theirs.keys, theirs.values)
        if extra:
            self._mask = torch.cat([self._mask, self._mask.new_zeros((extra, width))])
            self._last = torch.cat([self._last, self._last.new_zeros(extra)])
        self._mask.index_copy_(0, index, _pad_left(mask, width))
        self._last.index_copy_(0, index, first)
        for position, seq in zip(positions, seqs, strict=True):
            if position < len(self.rows):
                self.rows[position] = seq
            else:
                self.rows.append(seq)
        return positions

    def _trim(self) -> None:
        """Hide cache columns that are padding in every live row (a view change, no copy)."""
        live = [i for i, s in enumerate(self.rows) if not s.finished]
        if not live or self._mask is None:
            return
        used = self._mask[live].any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        if start:
            self._mask = self._mask[:, start:]
            for layer in self._cache.layers:
                layer.trim(start)

    def expire(self, now_ms: float) -> list[Sequence]:
        """Stop the rows whose deadline passed (their tokens so far stand); returns them."""
        done = [s for s in self.rows if not s.finished and s.deadline_ms is not None and s.deadline_ms <= now_ms]
        for seq in done:
            seq.finished = seq.expired = True
            seq.last_token_ms = now_ms
        self._live -= len(done)
        self._maybe_compact()
        return done

    def step(self) -> list[Sequence]:
        """Decode one token for every row; returns the rows that finished."""
        if not self._live:
            return []
        from .gqa_decode import own_columns

        ids, mask, positions = self.step_inputs()
        with own_columns(mask):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=self._cache,
                use_cache=True,
            )
        self._cache = out.past_key_values
        return self.stepped(mask, out.logits[:, -1, :].argmax(-1))

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's input: every row's next token `[rows, 1]`, the mask with the new column, positions."""
        import torch

        assert self._mask is not None and self._last is not None
        ones = torch.ones((len(self.rows), 1), dtype=self._mask.dtype, device=self._mask.device)
        mask = torch.cat([self._mask, ones], dim=1)
        positions = (mask.sum(-1, keepdim=True) - 1).clamp(min=0)
        return self._last.unsqueeze(-1), mask, positions

    @property
    def cache(self) -> Any:
        return self._cache

    def stepped(self, mask: torch.Tensor, tokens: torch.Tensor) -> list[Sequence]:
        """A step ran (its keys and values are in the cache): take its mask and each row's new token;
        returns the rows that finished."""
        self._mask, self._last = mask, tokens
        return self._accept(tokens)

    def _accept(self, tokens: torch.Tensor, positions: list[int] | None = None) -> list[Sequence]:
        """Append the new token (unless EOS) of the live rows at `positions` (all rows when None);
        returns those that are done."""
        done: list[Sequence] = []
        stamp = time.time() * 1000.0
        values = tokens.tolist()
        for row, token in zip(positions if positions is not None else range(len(values)), values, strict=True):
            seq = self.rows[row]
            if seq.finished:
                continue
            if token in self.stop_ids and not seq.ignore_eos:
                seq.finished = True
            else:
                seq.generated.append(token)
                seq.finished = len(seq.generated) >= seq.limit
            if seq.finished:
                seq.last_token_ms = stamp
                done.append(seq)
        self._live -= len(done)
        self._maybe_compact()
        return done

    def _maybe_compact(self) -> None:
        dead = len(self.rows) - self._live
        if dead and (not self._live or dead >= DEAD_SHARE * len(self.rows)):
            self._compact()

    def _compact(self) -> None:
        """Drop the done rows, and cache columns that are padding in all remaining rows."""
        if self._live == len(self.rows):
            return
        if not self._live:
            self.rows, self._cache, self._mask, self._last = [], None, None, None
            return
        import torch

        rows = [i for i, s in enumerate(self.rows) if not s.finished]
        assert self._mask is not None and self._last is not None
        index = torch.tensor(rows, dtype=torch.long, device=self._mask.device)
        mask = self._mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else 0
        for layer in self._cache.layers:
            layer.select(index, start)
        self._mask = mask[:, start:]
        self._last = self._last.index_select(0, index)
        self.rows = [self.rows[i] for i in rows]

    def _merge(self, cache: Any, mask: torch.Tensor, first: torch.Tensor, seqs: list[Sequence]) -> None:
        """Append prefilled rows: both caches left-padded to one width, then stacked."""
        import torch

        from .kv_slack import SlackLayer

        assert self._mask is not None and self._last is not None
        width = max(self._mask.shape[1], mask.shape[1])
        layers = self._cache.layers
        for i, (ours, theirs) in enumerate(zip(layers, cache.layers, strict=True)):
            layers[i] = SlackLayer.stacked([(ours.keys, ours.values), (theirs.keys, theirs.values)], width)
        self._mask = torch.cat([_pad_left(self._mask, width), _pad_left(mask, width)], dim=0)
        self._last = torch.cat([self._last, first], dim=0)
        self.rows.extend(seqs)


def prompt_tensors(seqs: list[Sequence], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts of `seqs` left-padded to the longest, and their attention mask."""
    import torch

    width = max(len(s.prompt) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, width - len(s.prompt) :] = torch.tensor(s.prompt, dtype=torch.long)
        mask[row, width - len(s.prompt) :] = 1
    return ids.to(device), mask.to(device)


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    """An attention mask left-padded with zeros to `width` columns."""
    import torch

    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], dim=1)


def _check_cache(cache: Any) -> None:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or ()}) or [type(cache).__name__]
        raise UnsupportedCache(
            f"running-set decoding needs full-attention dynamic cache layers (got {', '.join(kinds)})"
        )


def drop_expired(seqs: list[Sequence], now_ms: float) -> list[Sequence]:
    """The sequences still worth a prefill; those past their deadline are marked expired."""
    keep = []
    for seq in seqs:
        if seq.deadline_ms is not None and seq.deadline_ms <= now_ms:
            seq.finished = seq.expired = True
        else:
            keep.append(seq)
    return keep


def decode_all(running: RunningSet, seqs: list[Sequence]) -> None:
    """Static batching: prefill all, then step until every row finished or expired."""
    running.join(drop_expired(seqs, time.time() * 1000.0))
    while len(running):
        running.expire(time.time() * 1000.0)
        running.step()
