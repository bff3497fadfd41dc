"""Edge knockouts: "query positions Q may not read key positions K", per head or per layer, inside any trace or
generation step, on both engines.

`knock_out(model, layer, queries=Q, keys=K, heads=None)` edits the layer's pattern where the forward holds it: the
weights of the knocked-out edges are set to zero and each affected row's remaining weights are scaled back to the
row's own total (one, without a sink). Without a sink that is exactly masking those keys before the softmax. The
layer's head outputs are then computed from the edited pattern: by transformers' eager attention itself (the edit is
made before it multiplies the values), and on vLLM by attnlens's recomputation (`edited pattern @ kept values`).
Call it once per step (`tracer.iter`/`tracer.all()` under generation): on a decode step the rows are the new tokens'
positions and the keys span the context.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import Unavailable
from .reasons import knock_out_reason


def _positions(chosen, length: int, what: str) -> torch.Tensor:
    """A [length] mask of the positions in `chosen` (None: all)."""
    mask = torch.zeros(length, dtype=torch.bool)
    if chosen is None:
        return ~mask
    chosen = [chosen] if isinstance(chosen, int) else list(chosen)
    for position in chosen:
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"{what} positions are non-negative ints; got {position!r}")
        if position < length:
            mask[position] = True
    return mask


def knocked(pattern: torch.Tensor, queries=None, keys=None, heads: Iterable[int] | None = None) -> torch.Tensor:
    """`pattern` [batch, heads, query, key] with the edges from query positions `queries` to key positions `keys`
    (None: all) removed on `heads` (None: all), each affected row scaled back to its own total. The query rows are the
    last positions of the keys (a prefill, or a decode step over the whole context)."""
    _, num_heads, num_queries, num_keys = pattern.shape
    query_mask = _positions(queries, num_keys, "query")[num_keys - num_queries :]
    key_mask = _positions(keys, num_keys, "key")
    head_mask = _positions(None if heads is None else list(heads), num_heads, "head")
    if heads is not None and any(h >= num_heads for h in ([heads] if isinstance(heads, int) else heads)):
        raise ValueError(f"heads {heads} out of range: the layer has {num_heads}")
    edges = (head_mask[:, None, None] & query_mask[None, :, None] & key_mask[None, None, :]).to(pattern.device)
    kept = pattern.masked_fill(edges[None], 0)
    before, after = pattern.sum(-1, keepdim=True), kept.sum(-1, keepdim=True)
    scale = torch.where(after > 0, before / after.clamp_min(torch.finfo(after.dtype).tiny), torch.zeros_like(after))
    return kept * scale


def knock_out(model, layer: int, queries=None, keys=None, heads: Iterable[int] | None = None) -> None:
    """Inside a trace (or one step of a generation): remove the edges `queries` -> `keys` from `layer`'s pattern, on
    `heads` (default all: the whole layer). See the module docstring."""
    attn = model.layers[layer].self_attn
    access = attn.interleaver.attnlens.of(attn)  # the model's Access, also in vLLM's worker where the body runs
    layer = access.check_layer(layer)
    reason = knock_out_reason(access, layer)
    if reason is not None:
        raise Unavailable(f"knock_out on layer {layer} of {access.family.name}: {reason}")
    pattern = attn.attention_probabilities
    window = access.family.score_function(access.engine).window(access.config, layer)
    if (
        access.engine == "transformers"
        and window is not None
        and access.tokens_seen is not None
        and pattern.shape[-1] < access.tokens_seen
    ):
        raise Unavailable(
            f"knock_out on layer {layer}: under generate transformers keeps only the sliding window's "
            f"keys, so key positions are not key indexes here; knock out on the prefill, or on vLLM"
        )
    attn.attention_probabilities = knocked(pattern, queries, keys, heads)
