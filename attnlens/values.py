"""The catalogue of standardized values: one entry per value, in forward order.

Reading, `support()`, `order()` and the docs table are all derived from this list, so they cannot disagree.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

Scope = Literal["model", "layer", "attention", "mlp"]
#: The envoy that carries each scope's values.
HOSTS = {
    "model": "model",
    "layer": "model.layers[i]",
    "attention": "model.layers[i].self_attn",
    "mlp": "model.layers[i].mlp",
}


@dataclass(frozen=True)
class Value:
    name: str  #: the attribute name on its envoy
    short: str  #: the cache name (`run_with_cache`, static taps): TransformerLens-like, as the capture spec writes
    scope: Scope  #: which envoy carries it: the model, `layers[i]`, `layers[i].self_attn` or `layers[i].mlp`
    layout: str  #: axis names, in order
    meaning: str

    @property
    def key(self) -> str:
        """How `support()` and `order()` name it relative to a layer: `self_attn.attention_keys`, `layer_input`."""
        prefix = {"attention": "self_attn.", "mlp": "mlp."}.get(self.scope, "")
        return prefix + self.name

    @property
    def axes(self) -> list[str]:
        return self.layout.split()


MODEL_VALUES_BEFORE = (
    Value("embeddings", "embed", "model", "batch seq hidden", "the token embedding module's output"),
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
        "layer_mid",
        "resid_mid",
        "layer",
        "batch seq hidden",
        "the residual stream after attention, entering the MLP's norm",
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
BY_NAME = {value.name: value for value in ALL_VALUES}
BY_SHORT = {value.short: value for value in ALL_VALUES}
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
    return " Did you mean " + " or ".join(dict.fromkeys(f"{HOSTS[v.scope]}.{v.name}" for v in found)) + "?"
