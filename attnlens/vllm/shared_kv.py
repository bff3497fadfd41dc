"""Layers whose attention reuses an earlier layer's keys and values, on vLLM (Gemma 3n's and Gemma 4's last
`num_kv_shared_layers`).

vLLM builds such a layer's kernel with `kv_sharing_target_layer_name` (the earlier layer's kernel) and calls it as
`attn(q, None, None)`: it computes no keys or values and reads the target's from the KV cache. attnlens keeps every
layer's keys and values per request (`kept.History`), so a shared layer's are the target's kept rows, this step's
included (the target ran earlier in the same forward): the same tensors transformers hands that layer's attention
function. They are read-only there; they are edited on the layer that computes them.

The worker reads the target off each kernel at load (`source_layer`) and checks it against the family's own
`shared_from(config, layer)` where the family states one (`check`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import LocationDrift
from ..locations.views import gathered_heads


def source_layer(kernel: torch.nn.Module) -> int | None:
    """The layer whose keys and values vLLM's attention `kernel` reads, or None where it computes its own."""
    target = getattr(kernel, "kv_sharing_target_layer_name", None)
    if not target:
        return None
    found = re.search(r"(?:^|\.)layers\.(\d+)\.", target)
    if found is None:
        raise LocationDrift(f"vLLM's kernel shares the keys and values of {target!r}, which names no layer index")
    return int(found.group(1))


def check(family: Any, config: Any, layer: int, kernel: torch.nn.Module) -> int | None:
    """`source_layer` of `layer`'s kernel, checked against the family's `shared_from` (where it has one): a family that
    disagrees with vLLM about which layer's keys a layer reads fails at load, not with a wrong pattern."""
    source = source_layer(kernel)
    stated = getattr(family, "shared_from", None)
    says = stated(config, layer) if stated is not None else None
    if says != source:

        def whose(index):
            return "its own" if index is None else f"layer {index}'s"

        raise LocationDrift(
            f"family {family.name}, layer {layer}: the family says the layer attends with {whose(says)} keys and "
            f"values, vLLM's kernel with {whose(source)}; the rebuilt pattern would be wrong. Fix the family's "
            f"shared_from."
        )
    return source


def shared_heads(history: Any, source: int, end: int, which: int, head_dim: int, total: int) -> torch.Tensor:
    """Keys (1) or values (2) of the tokens before `end` kept at layer `source`, `[1, heads, tokens, dim]`."""
    return gathered_heads(history.upto(source, end, which - 1), head_dim, total)
