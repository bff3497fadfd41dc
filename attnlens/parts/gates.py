"""Output gates that multiply each head's output by one number per head and token (Laguna's softplus, LFM3's and
Bailing's sigmoids), served as `attention_gate` `[batch, seq, heads, head_dim]`: the forward's scalar broadcast over
the head's channels. A gate the forward holds per channel is a plain view (`locations.views.per_head`)."""

from __future__ import annotations

import torch

from ..errors import EditError
from ..locations import Derived, Location, Operation, context
from ..locations.views import gather_heads

REPEATED_WHY = (
    "the forward holds one factor per head (repeated here over head_dim); edit the head outputs or the premix instead"
)


def _head_dim(envoy) -> int:
    found = context(envoy)
    return found.geometry(found.layer_of(envoy)).head_dim


def _repeated(envoy, gate):
    return gate[..., None].expand(*gate.shape, _head_dim(envoy)).clone()  # [b, s, heads] -> [b, s, heads, d]


def repeated_head_gate(source: Location) -> Derived:
    """The gate `[batch, seq, heads]` at `source` repeated over each head's channels: a read-only copy."""
    return Derived(source, _repeated, None, "attention_gate", in_place=False, why_not=REPEATED_WHY)


def _repeated_on_ranks(envoy, gate):
    # vLLM holds one factor per head, [tokens, this rank's heads]: repeated over head_dim, every rank's heads
    found = context(envoy)
    heads = found.geometry(found.layer_of(envoy))
    return gather_heads(gate[None, ..., None].expand(-1, -1, -1, heads.head_dim).clone(), heads.num_heads, 2)


def repeated_head_gate_on_ranks(source: Location) -> Derived:
    """vLLM's gate `[tokens, this rank's heads]` at `source` as `[1, tokens, heads, head_dim]`, repeated over each
    head's channels, every rank's heads: a read-only copy."""
    return Derived(source, _repeated_on_ranks, None, "attention_gate", in_place=False, why_not=REPEATED_WHY)


def head_scalar_gate(operation: str, anchor: str, trailing: bool) -> Derived:
    """The sigmoid's output at `operation` (`[batch, seq, heads, 1]` where `trailing`, else `[batch, seq, heads]`)
    broadcast over the head's channels; assignable with a gate constant along them."""

    def channels(envoy, gate):
        gate = gate if trailing else gate.unsqueeze(-1)
        return gate.expand(*gate.shape[:3], _head_dim(envoy))

    def per_head(envoy, old, new):
        if not torch.equal(new, new[..., :1].expand_as(new)):
            raise EditError(
                "this family gates each head by one scalar per token: an assigned attention_gate must be "
                "constant along the head's channels"
            )
        return new[..., :1] if trailing else new[..., 0]

    return Derived(
        Operation((operation,), anchor=anchor),
        channels,
        per_head,
        label="attention_gate",
        in_place=False,
        why_not="the forward holds one gate value per head and token, broadcast over the channels; "
        "assign a gate constant along them",
    )
