"""A prompt chunk that rides in the decode step: one forward pass for the running rows and the chunk.

A chunk prefilled in a forward pass of its own costs, on a CPU, about a
decode step of a few rows before its first token (every weight is read
again, every kernel launched again), so a step followed by even a small
chunk took ~2x a plain one and the running rows' time per output token
doubled while a long prompt joined. Here the chunk is packed beside the
decode rows' tokens into one sequence, `[1, rows + chunk]`: the linear
layers and the MLP run once over all of it (weights read once), and only
attention is split, per layer, by an attention function installed on the
model (`install`):

- the first `rows` tokens are the decode rows' next tokens: each one's keys
  and values are written into the running set's cache and it attends its
  own row (`gqa_decode.decode_attention`, its own columns only);
- the rest are the chunks, one per riding group, each `group rows x columns`
  in row order: its keys and values are appended to the group's own cache,
  and it attends that cache with its padding mask and causal order, as a
  one-piece prefill does.

The model is called without a cache of its own (`use_cache=False`); the
attention function writes both caches. Positions are each token's own, so
rotary and learned position embeddings see what they would alone; only the
logits needed are computed (the rows' and, at the last chunk, the group's
last column). Padding queries of the chunk attend themselves only (never a
row of nothing, whose softmax would be NaN); their keys stay masked for
every real query, so the group's cache and first token are those of a
one-piece prefill and greedy outputs do not change (the tiny GPT-2 and
Llama tests compare them token for token).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import gqa_decode

if TYPE_CHECKING:
    import torch

    from .chunked_prefill import ChunkedPrefill
    from .decoding import RunningSet, Sequence

NAME = "batchtide_fused_step"

_local = threading.local()


@dataclass
class _Chunk:
    """One group's chunk in a fused pass: `group` rows x `columns`, in row order."""

    group: int
    columns: int
    cache: Any
    mask: torch.Tensor
    """`[group, 1, columns, end]` booleans: padding and causal order, each query itself always."""


@dataclass
class _Ride:
    """What the attention function of one fused pass needs, per layer."""

    rows: int
    decode_layers: list[Any]
    plan: gqa_decode.ColumnPlan
    chunks: list[_Chunk]


def _chunk_of(states: Any, at: int, chunk: _Chunk) -> Any:
    """The chunk's span of a fused pass's `states` (1, heads, tokens, dim), from token `at`, as
    (group, heads, columns, dim): one row per prompt of the chunk."""
    heads, dim = states.shape[1], states.shape[3]
    span = states[0, :, at : at + chunk.group * chunk.columns]
    return span.reshape(heads, chunk.group, chunk.columns, dim).transpose(0, 1)


def attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """Split attention inside a fused pass; the decode-step attention (`gqa_decode`) otherwise."""
    ride: _Ride | None = getattr(_local, "ride", None)
    if ride is None:
        return gqa_decode.attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = module.layer_idx
    rows = ride.rows
    heads, dim = query.shape[1], query.shape[3]

    def rows_of(states: Any) -> Any:
        return states[0, :, :rows].transpose(0, 1).unsqueeze(2)

    keys, values = ride.decode_layers[layer].update(rows_of(key), rows_of(value))
    parts = [gqa_decode.decode_attention(rows_of(query), keys, values, ride.plan, scaling).reshape(1, rows, heads, dim)]
    at = rows
    for chunk in ride.chunks:
        size = chunk.group * chunk.columns
        c_keys, c_values = chunk.cache.update(
            _chunk_of(key, at, chunk).contiguous(), _chunk_of(value, at, chunk).contiguous(), layer
        )
        out, _ = sdpa_attention_forward(
            module,
            _chunk_of(query, at, chunk),
            c_keys,
            c_values,
            chunk.mask,
            dropout=0.0,
            scaling=scaling,
            is_causal=False,
        )
        parts.append(out.reshape(1, size, heads, dim))
        at += size
    return torch.cat(parts, dim=1), None


def _mask(*args: Any, **kwargs: Any) -> Any:
    """No 4-D mask for a fused pass (its attention builds its own); transformers' SDPA mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    if getattr(_local, "ride", None) is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def install(model: Any) -> bool:
    """Use this attention for `model` (an SDPA causal LM): fused passes, and the decode-step
    attention of `gqa_decode` for every other pass. False (unchanged) for another implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, _mask)
    model.set_attn_implementation(NAME)
    return True


def supported(model: Any) -> bool:
    """Whether `model` runs fused passes (`install` took)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME


def ride(running: RunningSet, chunks: list[tuple[ChunkedPrefill, int | None]]) -> tuple[list[Sequence], int]:
    """One decode step of `running` with the next chunk of each prefill in `chunks` (about `tokens`
    tokens each, None: all the rest) in the same forward pass; returns the rows that finished and
    the prompt tokens fed."""
    import torch
    from transformers.cache_utils import DynamicCache

    ids, mask, positions = running.step_inputs()
    rows = int(ids.shape[0])
    device = ids.device
    packed, packed_positions, keep = [ids.flatten()], [positions.flatten()], [torch.arange(rows, device=device)]
    parts: list[tuple[ChunkedPrefill, int, _Chunk, int]] = []
    at = rows
    for prefill, tokens in chunks:
        start, end = prefill.span(tokens)
        group, columns = len(prefill.seqs), end - start
        packed.append(prefill.ids[:, start:end].flatten())
        packed_positions.append(prefill.positions[:, start:end].flatten())
        queries = torch.arange(start, end, device=device)[:, None]
        keys = torch.arange(end, device=device)[None, :]
        padding = prefill.mask[:, None, None, :end].bool()
        cache = prefill.cache if prefill.cache is not None else DynamicCache()
        chunk = _Chunk(group, columns, cache, (padding & (keys <= queries)) | (keys == queries))
        first_at = -1
        if end == prefill.width:
            first_at = sum(len(k) for k in keep)
            keep.append(at + torch.arange(group, device=device) * columns + columns - 1)
        parts.append((prefill, end, chunk, first_at))
        at += group * columns
    plan = gqa_decode.column_plan(mask) or gqa_decode.ColumnPlan(
        rows, int(mask.shape[1]), mask.bool()[:, None, None, :], 0, torch.empty(0, dtype=torch.long, device=device)
    )
    _local.ride = _Ride(rows, running.cache.layers, plan, [chunk for _, _, chunk, _ in parts])
    try:
        out = running.model(
            input_ids=torch.cat(packed).unsqueeze(0),
            position_ids=torch.cat(packed_positions).unsqueeze(0),
            use_cache=False,
            logits_to_keep=torch.cat(keep),
        )
    finally:
        _local.ride = None
    tokens_out = out.logits[0].argmax(-1)
    if str(running.device).startswith("cuda"):
        torch.cuda.synchronize()  # the pacer times the step: wait for it, not for its launch
    finished = running.stepped(mask, tokens_out[:rows])
    for prefill, end, chunk, first_at in parts:
        prefill.fed(end, chunk.cache, tokens_out[first_at : first_at + chunk.group] if first_at >= 0 else None)
    return finished, at - rows
