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
"""

from __future__ import annotations

from typing import Any

NAME = "batchtide_gqa_decode"


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
