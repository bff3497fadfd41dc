"""Cohere 2 MoE (Command A): Cohere's parallel block with sliding and full layers, rotary embedding only where the
window slides, and mixture-of-experts MLPs after a dense prefix.

As in Cohere, attention and the MLP read one `input_layernorm` output and join the block input in one sum, so
`layer_mid` is unavailable; `logits` are the LM head's output times `logit_scale`. Sliding layers
(`config.layer_types`) mask to `sliding_window` keys and rotate queries and keys; full layers rotate nothing (no
positional encoding at all), except the dense prefix layers when `prefix_dense_sliding_window_pattern == 1`. Layers
whose `config.mlp_layer_types` entry is not `"dense"` route tokens to experts (each applying its gated activation to
its own tokens), plus shared experts averaged or summed in, so no activation or neuron tensor exists there.
"""

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .cohere import Cohere


class Cohere2Moe(SparseMoE, Cohere):
    model_types = ("cohere2_moe",)
    tiny = Tiny(
        "Cohere2MoeConfig",
        "Cohere2MoeForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_shared_experts": 1,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "prefix_dense_intermediate_size": 128,
        },
    )
    absent = {
        **Cohere.absent,
        **moe_absent(
            "Cohere2MoeExperts",
            extra=", with the shared experts' output summed or averaged in (shared_expert_combination_strategy)",
        ),
    }

    def moe_layer(self, config, layer):
        return config.mlp_layer_types[layer] != "dense"

    @staticmethod
    def rotary(config, layer) -> bool:
        return config.layer_types[layer] == "sliding_attention" or (
            config.mlp_layer_types[layer] == "dense" and config.prefix_dense_sliding_window_pattern == 1
        )

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if self.rotary(config, layer):
            notes["attention_queries"] = notes["attention_keys"] = "rotated (interleaved pairs)"
        else:
            notes["attention_queries"] = notes["attention_keys"] = (
                "not rotated: this full-attention layer has no positional encoding"
            )
        return notes
