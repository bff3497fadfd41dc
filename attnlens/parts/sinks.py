"""Sink logits (GPT-OSS, DeepSeek-V4, Flint, Inkling 2, Hy-V4): each head's learned logit joins the softmax as one
extra key column that is dropped after it, so each row of the pattern sums to one less the sink's share."""

from __future__ import annotations

from ..locations import INTERFACE_CALL, Derived, Operation
from .eager import EagerFunction

SINK_NOTE = (
    "the softmax probability of the head's sink logit, the key column the eager function concatenates "
    "and drops after the softmax: 1 - the pattern's row sum; read-only (a view of the softmax output, "
    "whose sink column is discarded, so an edit could change nothing)"
)


def eager_with_sinks(**operations: tuple[str, str]) -> EagerFunction:
    """The eager function of a family with sinks (its `operations` where they differ from the common ones): the sink
    column, like the scores and the pattern, exists only inside it."""
    return EagerFunction(**operations, only=(*EagerFunction().only, "attention_sinks"))


def sink_share(operation: str) -> Derived:
    """`attention_sinks`: the last column of the softmax over [scores | sink] (assignment `operation`)."""
    return Derived(
        Operation((INTERFACE_CALL, operation), anchor="softmax("),
        view=lambda envoy, probs: probs[..., -1],
        label="attention_sinks",
        in_place=False,
        why_not="it is the softmax's sink column, which the forward drops right after the softmax, so "
        "nothing reads it; edit attention_scores or attention_probabilities instead",
    )


def with_sinks(locations: dict, sinks: Derived) -> dict:
    """`locations` with `attention_sinks` placed where the forward computes it: between scores and pattern."""
    ordered = {}
    for name, location in locations.items():
        if name == "attention_probabilities":
            ordered["attention_sinks"] = sinks
        ordered[name] = location
    return ordered
