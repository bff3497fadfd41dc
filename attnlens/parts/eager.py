"""transformers' eager attention function as a family's attention calls it: the assignments that hold the masked
scores and the pattern, and the values only it forms (the queries, keys, values and head outputs are the attention
function's arguments and result, there under every implementation; the scores and the pattern exist inside the eager
function alone)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EagerFunction:
    """Where the eager function holds the values only it forms. An operation is nnsight's name for an assignment, with
    text its line must contain (checked against the installed transformers when a model loads)."""

    #: The assignment holding the masked scores, and text on its line.
    scores: tuple[str, str] = ("attn_weights_1", "+ attention_mask")
    #: The assignment holding the pattern after softmax and dropout, and text on its line.
    probabilities: tuple[str, str] = ("attn_weights_3", "dropout(")
    #: The values that exist only inside it: unavailable under another attention implementation (sdpa). Empty where
    #: the family's attention has one path whatever `attn_implementation` says.
    only: tuple[str, ...] = ("attention_scores", "attention_probabilities")
