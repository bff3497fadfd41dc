"""GPT-2: one fused `c_attn` projection split into queries, keys and values; Conv1D projections; learned positions.

Queries are a view of the split, so torch refuses in-place edits of them under autograd: assign them instead. The
file-local eager function repeats no heads and does not upcast the softmax. With `reorder_and_upcast_attn` the
attention bypasses the attention interface entirely.
"""

from ..family import EagerFunction, Family, Tiny, VLLMLayout
from ..parts.fused import FusedQKV
from ..parts.mirrored import mirrored
from ..parts.sizes import Sizes


def _gpt2_vllm_locations(family):
    return mirrored(family, family.locations(), own_port=True)


class GPT2(Family):
    model_types = ("gpt2",)
    tiny = Tiny(
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "n_layer": 3,
            "n_embd": 64,
            "n_head": 4,
            "n_inner": 128,
            "n_positions": 128,
            "num_hidden_layers": None,
            "hidden_size": None,
            "num_attention_heads": None,
            "num_key_value_heads": None,
            "intermediate_size": None,
            "max_position_embeddings": None,
        },
    )
    layers = "transformer.h"
    embed_tokens = "transformer.wte"
    final_norm = "transformer.ln_f"
    attention = "attn"
    attention_norm = "ln_1"
    mlp_norm = "ln_2"
    output_projection = "c_proj"
    activation = "act"
    down_projection = "c_proj"
    eager = EagerFunction(probabilities=("attn_weights_4", "dropout("))
    fused_views = ("attention_queries",)
    fused_qkv = FusedQKV("c_attn", "blocks")
    vllm = VLLMLayout(
        locations=_gpt2_vllm_locations,
        model_types=("gpt2",),  # vLLM's own GPT2LMHeadModel
        tiny={"n_embd": 128},  # head size 32
    )
    sizes = Sizes(num_heads=("num_heads",))

    kind_reasons = {
        "*": dict.fromkeys(
            (
                "attention_queries",
                "attention_keys",
                "attention_values",
                "attention_scores",
                "attention_probabilities",
                "attention_head_outputs",
            ),
            lambda family, config, layer: (
                "config.reorder_and_upcast_attn=True routes GPT-2 attention through _upcast_and_reordered_attn, which "
                "attnlens does not read; load with reorder_and_upcast_attn=False"
                if getattr(config, "reorder_and_upcast_attn", False)
                else None
            ),
        )
    }
