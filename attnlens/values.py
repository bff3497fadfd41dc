"""The catalogue of standardized values: one entry per value, in forward order.

Reading, `support()`, `order()` and the docs table are all derived from this list, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scope = Literal["model", "layer", "attention", "mlp"]


@dataclass(frozen=True)
class Value:
    name: str  #: the attribute name on its envoy
    scope: Scope  #: which envoy carries it: the model, `layers[i]`, `layers[i].self_attn` or `layers[i].mlp`
    layout: str  #: axis names, in order
    meaning: str

    @property
    def key(self) -> str:
        """How `support()` and `order()` name it relative to a layer: `self_attn.attention_keys`, `layer_input`."""
        prefix = {"attention": "self_attn.", "mlp": "mlp."}.get(self.scope, "")
        return prefix + self.name


def _v(name: str, scope: Scope, layout: str, meaning: str) -> Value:
    return Value(name, scope, layout, meaning)


MODEL_VALUES_BEFORE = (
    _v("embeddings", "model", "batch seq hidden", "the token embedding module's output"),
)

LAYER_VALUES = (
    _v("layer_input", "layer", "batch seq hidden", "the residual stream entering the block"),
    _v("attention_norm_output", "layer", "batch seq hidden", "the normalised residual the attention reads"),
    _v("attention_queries", "attention", "batch num_heads seq qk_head_dim",
       "the queries entering attention, after the projection, rotary embedding and any QK-norm"),
    _v("attention_keys", "attention", "batch num_kv_heads seq qk_head_dim",
       "the keys entering attention, before grouped heads are repeated; under generate, as long as the cache"),
    _v("attention_values", "attention", "batch num_kv_heads seq head_dim",
       "the values entering attention, before grouped heads are repeated"),
    _v("attention_scores", "attention", "batch num_heads query key",
       "the scaled scores entering the softmax, soft-capped and masked (masked entries hold the dtype's minimum)"),
    _v("attention_probabilities", "attention", "batch num_heads query key",
       "the pattern the values are mixed with: after the softmax and its dropout"),
    _v("attention_sinks", "attention", "batch num_heads query",
       "the share of each query's softmax mass taken by the head's sink logit (1 - the pattern's row sum)"),
    _v("attention_head_outputs", "attention", "batch seq num_heads head_dim",
       "each head's mix of the values, before the heads are merged (and before any output gate)"),
    _v("attention_gate", "attention", "batch seq num_heads head_dim",
       "the output gate multiplying each head's output (after its sigmoid): head outputs * gate, merged, is the premix"),
    _v("attention_premix", "attention", "batch seq num_heads*head_dim",
       "what the output projection receives: the heads merged"),
    _v("attention_output", "attention", "batch seq hidden", "the attention sublayer's output"),
    _v("layer_mid", "layer", "batch seq hidden", "the residual stream after attention, entering the MLP's norm"),
    _v("mlp_norm_output", "layer", "batch seq hidden", "the output of the norm in front of the MLP"),
    _v("mlp_input", "layer", "batch seq hidden", "what the MLP module receives"),
    _v("mlp_activation", "mlp", "batch seq intermediate", "the activation function's output"),
    _v("mlp_neurons", "mlp", "batch seq intermediate",
       "what the MLP's down projection receives (the activation times the up projection where gated)"),
    _v("mlp_output", "mlp", "batch seq hidden", "the MLP's output"),
    _v("layer_output", "layer", "batch seq hidden", "the residual stream leaving the block"),
)

MODEL_VALUES_AFTER = (
    _v("final_norm_output", "model", "batch seq hidden", "the final norm's output"),
    _v("logits", "model", "batch seq vocab", "the language-model head's output"),
)

ALL_VALUES = MODEL_VALUES_BEFORE + LAYER_VALUES + MODEL_VALUES_AFTER
BY_NAME = {value.name: value for value in ALL_VALUES}
BY_KEY = {value.key: value for value in LAYER_VALUES}
ATTENTION_VALUES = tuple(v for v in LAYER_VALUES if v.scope == "attention")
