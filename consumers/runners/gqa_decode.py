"""Decode-step attention that reads the KV cache once per key/value head, not once per query head.

Models with grouped-query attention (SmolLM2-135M: 9 query heads share 3
key/value heads) hand SDPA keys and values repeated per query head whenever
an attention mask is present, and a running set always has one (its rows are
left-padded to one width). That `repeat_kv` copies the whole cache three
times per layer per step: at 128 rows and ~160 cached tokens it was ~60% of
a step's CPU in torch's profiler, and a step took 1.8 s instead of 0.5 s.

A decode step has one query per row, so the query heads of a group can stand
in for query positions: `[rows, kv_heads, group, dim]` against the unrepeated
`[rows, kv_heads, width, dim]` keys, with the row's padding mask broadcast
over the group. Same arithmetic, no copy. Prefill (many queries) and models
without groups take transformers' own SDPA path.

Rows attend only their own columns: the running set's rows are left-padded
to its widest row, so after a 512-token prompt joins, every short row's
step read ~500 padding columns per layer. A step's `own_columns(mask)`
splits the rows in two when that reads less: all rows over the columns the
narrow ones use, then the few wide rows alone over the whole width.
Padding columns weigh exactly zero in the softmax, so the tokens are the
same (measurements in docs/runners.md, "Fused chunks").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NAME = "batchtide_gqa_decode"
NARROW_GAIN = 0.8
"""Split the rows only when the two passes read at most this share of the columns one pass reads."""

_local = threading.local()


@dataclass(frozen=True)
class ColumnPlan:
    """One decode step's split: every row over columns `[cut:)`, then the `wide` rows over all."""

    rows: int
    width: int
    mask: torch.Tensor
    """The step's padding mask, `[rows, 1, 1, width]` booleans."""
    cut: int
    wide: torch.Tensor


def column_plan(mask: torch.Tensor) -> ColumnPlan | None:
    """The split of a step whose 2-D padding mask (new column included) is `mask`, or None when
    one pass over the whole width reads about as little. Keys read: rows x (width - cut) for the
    narrow pass, twice wide x width for the wide rows (their keys are gathered, a copy)."""
    import torch

    rows, width = int(mask.shape[0]), int(mask.shape[1])
    if rows < 2:
        return None
    starts = mask.to(torch.int8).argmax(-1)
    ordered = sorted(starts.tolist())
    best, cut = float(rows * width), 0
    for wide in range(1, rows):
        cost = rows * (width - ordered[wide]) + 2 * wide * width
        if cost < best:
            best, cut = cost, ordered[wide]
    if cut == 0 or best > NARROW_GAIN * rows * width:
        return None
    index = (starts < cut).nonzero().flatten()
    return ColumnPlan(rows, width, mask.bool()[:, None, None, :], cut, index)


@contextmanager
def own_columns(mask: torch.Tensor) -> Iterator[None]:
    """Decode-step attention in this block (this thread) reads each row's own columns only."""
    _local.plan = column_plan(mask)
    try:
        yield
    finally:
        _local.plan = None


def decode_attention(query: Any, key: Any, value: Any, plan: ColumnPlan, scaling: float | None) -> Any:
    """One query per row, its heads folded over the key/value heads, along `plan`: `[rows, 1, heads, dim]`."""
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows, heads, _, dim = query.shape
    folded = query.reshape(rows, key.shape[1], heads // key.shape[1], dim)
    cut = plan.cut
    out = sdpa(folded, key[:, :, cut:], value[:, :, cut:], attn_mask=plan.mask[..., cut:], scale=scaling)
    if cut and plan.wide.numel():
        wide = plan.wide
        full = sdpa(folded[wide], key[wide], value[wide], attn_mask=plan.mask[wide], scale=scaling)
        out = out.index_copy(0, wide, full)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous()


def active_plan(query: Any, key: Any) -> ColumnPlan | None:
    """The plan of this thread's step when `query`/`key` are that step's (one query per row)."""
    plan: ColumnPlan | None = getattr(_local, "plan", None)
    if plan is None or query.shape[2] != 1 or query.shape[0] != plan.rows or key.shape[-2] != plan.width:
        return None
    return plan


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
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan = active_plan(query, key)
    if plan is not None and kwargs.get("position_bias") is None:
        return decode_attention(query, key, value, plan, scaling), None
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    rows, heads, _, dim = query.shape
    folded = query.reshape(rows, key.shape[1], groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).contiguous(), None


def install(model: Any) -> bool:
    """Use this attention for `model` if it has grouped heads; False (unchanged) otherwise."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if not heads or not kv_heads or heads == kv_heads or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
