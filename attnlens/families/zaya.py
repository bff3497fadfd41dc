"""ZAYA1: Compressed Convolutional Attention, learned affine residual adds kept in float32, and a mixture-of-experts
MLP whose router carries a state from block to block.

- `self_attn.qkv_proj` (ZayaCCAProjection) makes the queries and keys with a causal convolution over time on top
  of their projections (plus residual projection paths), and the values half from the current token and half from
  the previous token's delayed projection; `self_attn.qk_norm` then scales each query and key head to norm
  sqrt(head_dim) and the keys by a learned per-key/value-head `temp`. The queries, keys and values are read where
  the attention function receives them (after that and the rotary embedding), so the scores are the common
  `q @ k^T * head_dim ** -0.5` plus the mask; "hybrid_sliding" layers slide over `sliding_window` keys.
- The residual stream is float32 (`residual_in_fp32`) whatever the weights' dtype. Each add is affine:
  `layer_mid = post_attention_residual_scale(attention_output, layer_input)` = `(attention_output + b_h) * s_h +
  (layer_input + b_r) * s_r` with the module's learned vectors, and `layer_output =
  post_mlp_residual_scale(mlp_output, layer_mid)` likewise. `layer_mid` is that module's output, the float32 stream;
  the MLP's norm reads it cast to its own weights' dtype (the same tensor in float32).
- The MLP (`ZayaSparseMoeBlock`) routes each token to `num_experts_per_tok` of `num_experts` experts or to a skip
  class that adds nothing. Its router adds the previous block's router state (`prev_router_hidden_states`, the
  block's second argument) to its own down projection, so `mlp_output` depends on that state as well as on
  `mlp_input`: the identity suite passes it (`Identities.block_arguments`). The block returns `(output, router state)`;
  `layer_output` and `mlp_output` are the first items.
- `embeddings` is the token embedding module's output; the first block's input is `((embeddings +
  input_hidden_states_bias) * input_hidden_states_scale)` in float32.
"""

from ..family import Tiny, VLLMLayout
from ..locations import ModuleOutput
from ..parts import identities, scoring
from ..parts.moe import SparseMoE, moe_absent
from ..parts.vllm import computes_otherwise
from .llama import Llama


class Zaya(SparseMoE, Llama):
    model_types = ("zaya",)
    vllm = VLLMLayout(
        refusal=computes_otherwise(
            "Zaya",
            "on the tiny checkpoint (TransformersMoEForCausalLM, head size 32) its first greedy token already "
            "differs from transformers', log-probabilities 0.42 apart",
        )
    )
    tiny = Tiny(
        "ZayaConfig",
        "ZayaForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "router_hidden_size": 32,
            "sliding_window": 4,
            "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
        },
    )
    absent = moe_absent("ZayaExperts", "; a token routed to the skip class gets nothing from it")

    class Identities(identities.Identities):
        block_arguments = {"router_state": 1}

        def residual_add(self, block, sublayer, stream, update, **arguments):
            return getattr(
                block, self.family.attention_residual if sublayer == "attention" else self.family.mlp_residual
            )(update, stream)

        def residual_read(self, owner, sublayer, stream):
            norm = (
                owner.model.norm
                if sublayer == "final"
                else getattr(owner, self.family.attention_norm if sublayer == "attention" else self.family.mlp_norm)
            )
            return stream.to(dtype=norm.weight.dtype)

        def mlp_forward(self, mlp, mlp_input, router_state=None, **arguments):
            return mlp(mlp_input, router_state)[0]

    attention_residual, mlp_residual = "post_attention_residual_scale", "post_mlp_residual_scale"

    def locations(self):
        return {**super().locations(), "layer_mid": ModuleOutput(self.attention_residual)}

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return config.sliding_window if config.layer_types[layer] == "hybrid_sliding" else None

    kind_notes = {
        "*": {
            "layer_input": lambda family, config, layer: (
                "the float32 residual stream"
                + (
                    " (block 0: (embeddings + input_hidden_states_bias) * input_hidden_states_scale)"
                    if layer == 0
                    else ""
                )
            ),
            "layer_mid": "post_attention_residual_scale(attention_output, layer_input): (attention_output + b_h) * s_h "
            "+ (layer_input + b_r) * s_r, float32; the MLP's norm reads it cast to its weights' dtype",
            "layer_output": "post_mlp_residual_scale(mlp_output, layer_mid), affine as layer_mid's, float32",
            "attention_queries": "after the CCA projection (a causal convolution over time on q and k), qk_norm "
            "(each head scaled to norm sqrt(head_dim)) and the rotary embedding",
            "attention_keys": "after the CCA projection, qk_norm (norm sqrt(head_dim), times the learned per-head "
            "temp) and the rotary embedding",
            "attention_values": "half of each head from the current token's projection, half from the previous "
            "token's delayed projection (v_proj_current, v_proj_delayed)",
            "mlp_output": "the routed experts' weighted sum (the skip class adds nothing); the routing also "
            "depends on the router state the previous block hands this one (prev_router_hidden_states)",
        }
    }
