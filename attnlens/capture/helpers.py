"""Helpers over captured values: the per-head values attention mixes, gated attention's output gate, and the split
of a fused query/key/value projection by the family's own layout."""

from __future__ import annotations

import torch

from ..errors import Unavailable
from ..names import Cache


def per_head_value(model, cache: Cache, layer: int, *, expand: bool = True) -> torch.Tensor:
    """The values as the family feeds them to attention, [batch, key, heads, head_dim], from `"value.<layer>"`.

    With `expand` (the default) grouped key/value heads are repeated to one per query head, the grouping the
    family's attention uses, so `einsum("bhqk,bkhd->bqhd", probs, value)` is the head outputs (before any output
    gate: see `attn_out_gate`). `expand=False` keeps the key/value heads: [batch, key, kv_heads, head_dim]."""
    layer = model.access.check_layer(layer)
    values = cache.get("value", layer)  # [batch, kv_heads, key, head_dim], as the attention function received them
    heads = model.access.geometry(layer)
    num_heads, num_kv_heads = heads.num_heads, heads.num_kv_heads
    if values.shape[1] != num_kv_heads:
        raise ValueError(
            f"'value.{layer}' has {values.shape[1]} heads, but layer {layer} of {model.family.name} "
            f"has {num_kv_heads} key/value heads: is this cache from this model?"
        )
    if expand:
        values = model.family.score_function().repeat_kv(values, num_heads // num_kv_heads)
    return values.transpose(1, 2)


def attn_out_gate(model, cache: Cache, layer: int) -> torch.Tensor:
    """The output gate multiplying each head's output, [batch, seq, heads, head_dim], from `"attn_gate.<layer>"`.

    On a gated-attention family (Qwen3-Next, Qwen3.5) the head outputs times this gate, merged, is what the output
    projection receives. A family without a gate raises `attnlens.Unavailable` naming it."""
    layer = model.access.check_layer(layer)
    reason = model.access.reasons(layer).get("attention_gate")
    if reason is not None:
        raise Unavailable(
            f"attn_out_gate: layer {layer} of the {model.family.name} family has no output gate: {reason}"
        )
    return cache.get("attn_gate", layer)


def split_fused_qkv(model, fused: torch.Tensor, layer: int = 0) -> dict[str, torch.Tensor]:
    """Split a fused query/key/value projection's output with the family's own layout.

    `fused` is the projection's output, [..., width] (cache name `"qkv.<layer>"`). Returns
    `{"q": [..., heads, head_dim], "k": [..., kv_heads, head_dim], "v": [..., kv_heads, head_dim]}`, before any
    rotary embedding or norm. Raises on a family without a fused projection and on a tensor of the wrong width."""
    layer = model.access.check_layer(layer)
    layout = model.family.fused_qkv
    if layout is None:
        raise Unavailable(
            f"split_fused_qkv: the {model.family.name} family has separate query, key and value "
            f"projections; nothing is fused"
        )
    heads = model.access.geometry(layer)
    return layout.split(
        fused,
        heads.num_heads,
        heads.num_kv_heads,
        heads.head_dim,
        where=f"layer {layer} of the {model.family.name} family",
    )
