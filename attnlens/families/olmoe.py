"""OLMoE: the Llama layout with QK-norm over the whole projection and a sparse mixture-of-experts MLP on every layer.

`q_norm`/`k_norm` RMS-normalise the full query and key projections (all heads together) before the head split and the
rotary embedding; with `config.clip_qkv` the projections are then clamped. The queries and keys are read after all of
it. Every layer's MLP (`OlmoeSparseMoeBlock`) routes each token to its top-k experts (moe.py).

vLLM's OLMoE does not clamp: with `clip_qkv` set, its queries, keys and values are unclipped (a note says so there).
"""

from dataclasses import replace

from ..family import Joined, Tiny
from ..parts.moe import SparseMoE, moe_absent
from .llama import Llama


class Olmoe(SparseMoE, Llama):
    model_types = ("olmoe",)
    tiny = Tiny("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2})
    absent = moe_absent("OlmoeExperts")
    vllm = replace(
        Llama.vllm,
        model_types=("olmoe",),
        tiny={"hidden_size": 128},  # vLLM's head size is hidden_size // num_attention_heads
    )

    kind_notes = {
        "*": {
            "attention_queries": "RMS-normalised over all heads together (q_norm over num_heads * head_dim) "
            "before the head split, then rotated",
            "attention_keys": "RMS-normalised over all key/value heads together (k_norm) before the head split, "
            "then rotated",
        },
        "vllm": dict.fromkeys(
            ("attention_queries", "attention_keys", "attention_values"),
            Joined(
                lambda family, config, layer: (
                    None
                    if config.clip_qkv is None
                    else f"not clamped to config.clip_qkv ({config.clip_qkv:g}): vLLM's OLMoE ignores it, so values "
                    f"differ from transformers' wherever a projection exceeds it"
                )
            ),
        ),
    }
