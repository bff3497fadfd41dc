"""The catalogue of standardized values: one entry per value, in forward order.

Reading, `support()`, `order()` and the docs table are all derived from this list, so they cannot disagree.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

Scope = Literal["model", "layer", "attention", "cross_attention", "mlp"]
#: The envoy that carries each scope's values.
HOSTS = {
    "model": "model",
    "layer": "model.layers[i]",
    "attention": "model.layers[i].self_attn",
    "cross_attention": "model.decoder.layers[i].cross_attn",
    "mlp": "model.layers[i].mlp",
}
#: The sublayer envoy each scope's values are read on, from a block.
SUBLAYER_OF = {"attention": "self_attn", "cross_attention": "cross_attn", "mlp": "mlp"}


@dataclass(frozen=True)
class Value:
    name: str  #: the name attnlens knows it by: the attribute on its envoy, but for a cross-attention value
    short: str  #: the cache name (`run_with_cache`, static taps): TransformerLens-like, as the capture spec writes
    scope: Scope  #: which envoy carries it: the model, `layers[i]`, `layers[i].self_attn` or `layers[i].mlp`
    layout: str  #: axis names, in order
    meaning: str

    @property
    def attribute(self) -> str:
        """The attribute it is read as on its envoy: its name, but on `cross_attn` the attention value's own name
        (`cross_attention_keys` is `cross_attn.attention_keys`)."""
        return self.name.removeprefix("cross_") if self.scope == "cross_attention" else self.name

    @property
    def key(self) -> str:
        """How `support()` and `order()` name it relative to a layer: `self_attn.attention_keys`, `layer_input`,
        `cross_attn.attention_probabilities`."""
        sublayer = SUBLAYER_OF.get(self.scope)
        return f"{sublayer}.{self.attribute}" if sublayer else self.name

    @property
    def axes(self) -> list[str]:
        return self.layout.split()


MODEL_VALUES_BEFORE = (
    Value("embeddings", "embed", "model", "batch seq hidden", "the token embedding module's output"),
)

#: Cross-attention, in an encoder-decoder's decoder blocks: the attention values again, with queries from the decoder
#: and keys and values from the encoder's output (its `source` positions), read on `model.decoder.layers[i].cross_attn`
#: under the attention value's own name. Their keys and values are computed once, on the first step, and cached.
CROSS_VALUES = (
    Value(
        "cross_attention_queries",
        "cross_query",
        "cross_attention",
        "batch num_heads seq qk_head_dim",
        "the cross-attention's queries, from the decoder's stream",
    ),
    Value(
        "cross_attention_keys",
        "cross_key",
        "cross_attention",
        "batch num_kv_heads source qk_head_dim",
        "the cross-attention's keys, from the encoder's output (one per source position)",
    ),
    Value(
        "cross_attention_values",
        "cross_value",
        "cross_attention",
        "batch num_kv_heads source head_dim",
        "the cross-attention's values, from the encoder's output",
    ),
    Value(
        "cross_attention_scores",
        "cross_scores",
        "cross_attention",
        "batch num_heads query source",
        "the cross-attention's scaled scores entering the softmax, masked where the source is padding",
    ),
    Value(
        "cross_attention_probabilities",
        "cross_probs",
        "cross_attention",
        "batch num_heads query source",
        "the cross-attention's pattern: each decoder position's weights over the encoder's positions",
    ),
    Value(
        "cross_attention_head_outputs",
        "cross_z",
        "cross_attention",
        "batch seq num_heads head_dim",
        "each cross-attention head's mix of the encoder's values, before the heads are merged",
    ),
    Value(
        "cross_attention_premix",
        "cross_premix",
        "cross_attention",
        "batch seq num_heads*head_dim",
        "what the cross-attention's output projection receives: the heads merged",
    ),
    Value(
        "cross_attention_output",
        "cross_attn_out",
        "cross_attention",
        "batch seq hidden",
        "the cross-attention sublayer's output",
    ),
)

LAYER_VALUES = (
    Value("layer_input", "resid_pre", "layer", "batch seq hidden", "the residual stream entering the block"),
    Value(
        "attention_norm_output", "attn_norm", "layer", "batch seq hidden", "the normalised residual the attention reads"
    ),
    Value(
        "attention_cache_keys",
        "cache_key",
        "attention",
        "batch num_kv_heads position qk_head_dim",
        "the keys the request's KV cache holds for the positions before this step (as the kernel receives them: "
        "after rotary embedding and any QK-norm), read as the step enters the attention; assigning them edits the "
        "cache, which this step and every later one attend to",
    ),
    Value(
        "attention_cache_values",
        "cache_value",
        "attention",
        "batch num_kv_heads position head_dim",
        "the values the request's KV cache holds for the positions before this step; assigning them edits the cache",
    ),
    Value(
        "attention_cache_visible",
        "cache_visible",
        "attention",
        "batch position",
        "True where this step and later ones attend to a cached position (False outside a sliding window or once "
        "removed); assign False at a position to remove it from what they attend to",
    ),
    Value(
        "attention_queries",
        "query",
        "attention",
        "batch num_heads seq qk_head_dim",
        "the queries entering attention, after the projection, rotary embedding and any QK-norm",
    ),
    Value(
        "attention_keys",
        "key",
        "attention",
        "batch num_kv_heads seq qk_head_dim",
        "the keys entering attention, before grouped heads are repeated; under generate, as long as the cache",
    ),
    Value(
        "attention_values",
        "value",
        "attention",
        "batch num_kv_heads seq head_dim",
        "the values entering attention, before grouped heads are repeated",
    ),
    Value(
        "attention_key_positions",
        "key_pos",
        "attention",
        "batch key",
        "each key's position in the sequence (read-only): 0..seq-1 on a prefill; under generate, the positions of "
        "the keys the step attends over (on a sliding-window layer, the window's)",
    ),
    Value(
        "attention_position_bias",
        "pos_bias",
        "attention",
        "batch num_heads query key",
        "a term the attention adds to the scores before the softmax that the queries and keys do not give: T5's "
        "bucketed relative position bias, learned in the first block and shared by the others (batch axis of one); "
        "assigning it moves the scores",
    ),
    Value(
        "attention_scores",
        "attn_scores",
        "attention",
        "batch num_heads query key",
        "the scaled scores entering the softmax, soft-capped and masked (masked entries hold the dtype's minimum)",
    ),
    Value(
        "attention_probabilities",
        "attn_probs",
        "attention",
        "batch num_heads query key",
        "the pattern the values are mixed with: after the softmax and its dropout",
    ),
    Value(
        "attention_sinks",
        "attn_sinks",
        "attention",
        "batch num_heads query",
        "the share of each query's softmax mass taken by the head's sink logit (1 - the pattern's row sum)",
    ),
    Value(
        "attention_head_outputs",
        "z",
        "attention",
        "batch seq num_heads head_dim",
        "each head's mix of the values, before the heads are merged (and before any output gate)",
    ),
    Value(
        "attention_gate",
        "attn_gate",
        "attention",
        "batch seq num_heads head_dim",
        "the output gate multiplying each head's output (after its sigmoid): head outputs * gate, merged, is the "
        "premix",
    ),
    Value(
        "attention_premix",
        "premix",
        "attention",
        "batch seq num_heads*head_dim",
        "what the output projection receives: the heads merged",
    ),
    Value("attention_output", "attn_out", "attention", "batch seq hidden", "the attention sublayer's output"),
    Value(
        "cross_attention_input",
        "resid_cross",
        "layer",
        "batch seq hidden",
        "the residual stream entering an encoder-decoder's cross-attention sublayer: after self-attention",
    ),
    Value(
        "cross_attention_norm_output",
        "cross_norm",
        "layer",
        "batch seq hidden",
        "the normalised residual the cross-attention reads its queries from",
    ),
    *CROSS_VALUES,
    Value(
        "layer_mid",
        "resid_mid",
        "layer",
        "batch seq hidden",
        "the residual stream after attention (and cross-attention), entering the MLP's norm",
    ),
    Value("mlp_norm_output", "mlp_norm", "layer", "batch seq hidden", "the output of the norm in front of the MLP"),
    Value("mlp_input", "mlp_in", "layer", "batch seq hidden", "what the MLP module receives"),
    Value("mlp_activation", "mlp_act", "mlp", "batch seq intermediate", "the activation function's output"),
    Value(
        "mlp_neurons",
        "mlp_neurons",
        "mlp",
        "batch seq intermediate",
        "what the MLP's down projection receives (the activation times the up projection where gated)",
    ),
    Value("mlp_output", "mlp_out", "mlp", "batch seq hidden", "the MLP's output"),
    Value("layer_output", "resid_post", "layer", "batch seq hidden", "the residual stream leaving the block"),
)

MODEL_VALUES_AFTER = (
    Value("final_norm_output", "final_norm", "model", "batch seq hidden", "the final norm's output"),
    Value("logits", "logits", "model", "batch seq vocab", "the language-model head's output"),
)

ALL_VALUES = MODEL_VALUES_BEFORE + LAYER_VALUES + MODEL_VALUES_AFTER
#: The values only a block with cross-attention has (`Family.cross_attention`): `support()` lists them there only.
WITH_CROSS_ATTENTION = frozenset(value.name for value in CROSS_VALUES) | {
    "cross_attention_input",
    "cross_attention_norm_output",
}
BY_NAME = {value.name: value for value in ALL_VALUES}
BY_SHORT = {value.short: value for value in ALL_VALUES}
#: By how `support()` and `order()` name each value (`Value.key`: `cross_attn.attention_keys`).
BY_KEY = {value.key: value for value in ALL_VALUES}
#: What every family's attention kernel receives: standardized name -> cache short name. Reductions at vLLM's
#: attention op (attnlens.vllm.reducer) read these and only these.
KERNEL_VALUES = {name: BY_NAME[name].short for name in ("attention_queries", "attention_keys", "attention_values")}


def of_scope(*scopes: Scope) -> tuple[str, ...]:
    """The names of the values carried by these scopes, in forward order."""
    return tuple(value.name for value in ALL_VALUES if value.scope in scopes)


def model_position(name: str, num_layers: int) -> tuple[int, int]:
    """Where a model value falls in the whole forward, as (block, rank): before the first block or after the last."""
    index = [value.name for value in ALL_VALUES if value.scope == "model"].index(name)
    return (-1, index) if BY_NAME[name] in MODEL_VALUES_BEFORE else (num_layers, index)


def closest(name: str) -> str:
    """A hint for a misspelled value name: the nearest standardized values (by name or cache name), and where each
    lives; "" when none is near."""
    near = difflib.get_close_matches(name, [*BY_NAME, *BY_SHORT], n=3, cutoff=0.5)
    found = [BY_NAME.get(n) or BY_SHORT[n] for n in near]
    if not found:
        return ""
    return " Did you mean " + " or ".join(dict.fromkeys(f"{HOSTS[v.scope]}.{v.attribute}" for v in found)) + "?"
