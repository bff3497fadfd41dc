"""GLM-4: partial, interleaved rotary embedding; a norm after attention and after the MLP; a fused gate/up MLP
projection.

The rotary embedding turns only the first `partial_rotary_factor` of each head's query and key dimensions, in
interleaved pairs (0-1, 2-3, ...); the rest pass unrotated. The queries and keys are read after it. The block adds
`post_self_attn_layernorm(attention_output)` to the residual, normalises that with `post_attention_layernorm` for the
MLP (the norm in front of the MLP, despite its name) and adds `post_mlp_layernorm(mlp_output)`. The MLP splits
`gate_up_proj` into gate and up; `mlp_activation` is `activation_fn(gate)`, `mlp_neurons` is `up * activation`.
"""

from dataclasses import replace

from ..family import Tiny
from .llama import Llama


def rotary_note(family, config, layer) -> str:
    factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
    return f"rotated on the first {factor:g} of each head's dimensions, in interleaved pairs; the rest unrotated"


class Glm4(Llama):
    model_types = ("glm4",)
    tiny = Tiny("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16})
    vllm = replace(
        Llama.vllm,
        model_types=("glm4",),  # vLLM's post-norms sit outside its fused (hidden, residual) norms: the defaults hold
    )
    attention_post_norm = "post_self_attn_layernorm"
    mlp_post_norm = "post_mlp_layernorm"
    activation = "activation_fn"

    kind_notes = {
        "*": {
            "attention_queries": rotary_note,
            "attention_keys": rotary_note,
            "layer_output": "layer_mid + post_mlp_layernorm(mlp_output): a norm follows the MLP",
        }
    }
