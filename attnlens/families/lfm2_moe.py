"""LFM2-MoE: LFM2's hybrid of short convolutions and attention, with sparse mixture-of-experts MLPs after
`num_dense_layers` dense ones.

Everything but the MLP is LFM2's. From layer `num_dense_layers` on, `feed_forward` routes each token to its top-k
experts, each applying its gated activation to its own tokens, so no activation or neuron tensor exists there; the
dense layers serve them as LFM2 does.
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .lfm2 import Lfm2


class Lfm2Moe(SparseMoE, Lfm2):
    model_types = ("lfm2_moe",)
    tiny = Tiny(
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        {
            "layer_types": ["conv", "full_attention", "conv"],
            "num_dense_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
    )
    absent = moe_absent("Lfm2MoeExperts")
    vllm = replace(
        Lfm2.vllm,
        model_types=("lfm2_moe",),
        tiny={"hidden_size": 128, "block_dim": 128, "layer_types": ["full_attention", "conv", "full_attention"]},
    )

    def moe_layer(self, config, layer):
        return layer >= config.num_dense_layers
