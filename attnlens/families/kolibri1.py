"""Kolibri 1: per-head QK RMSNorm before the rotary embedding, GLM-4's norms after each sublayer
(`post_self_attn_layernorm`, `post_mlp_layernorm`; `post_attention_layernorm` is the norm in front of the MLP), and a
mixture of experts as every MLP, so no activation or neuron tensor exists.
"""

from ..family import Family, Tiny, VLLMLayout
from ..parts.moe import SparseMoE, moe_absent
from ..parts.vllm import not_in_transformers


class Kolibri1(SparseMoE, Family):
    model_types = ("kolibri1",)
    vllm = VLLMLayout(refusal=not_in_transformers("Kolibri1", "Kolibri1ForCausalLM", "Kolibri1Config", "kolibri1"))
    tiny = Tiny(
        "Kolibri1Config",
        "Kolibri1ForCausalLM",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    )
    attention_post_norm = "post_self_attn_layernorm"
    mlp_post_norm = "post_mlp_layernorm"
    absent = moe_absent(
        "Kolibri1Experts", " plus mlp.shared_experts(mlp_input), a dense MLP every token passes through"
    )

    kind_notes = {
        "*": {
            "attention_queries": "RMS-normalised per head (q_norm), then rotated",
            "attention_keys": "RMS-normalised per head (k_norm), then rotated",
            "layer_output": "layer_mid + post_mlp_layernorm(mlp_output): a norm follows the MLP",
        }
    }
