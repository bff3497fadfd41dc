"""Qwen3-MoE: Qwen3's attention (per-head RMSNorm on queries and keys before the rotary embedding) with a sparse
MoE MLP.

On MoE layers `mlp_activation` and `mlp_neurons` are unavailable (each expert forms them for its own tokens inside
`mlp.experts`) and `mlp_output` is the routing-weighted sum of the chosen experts. Layers in `config.mlp_only_layers`,
or off the `decoder_sparse_step`, keep a dense gated MLP and serve every MLP value. `use_sliding_window` slides every
layer's window.
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .qwen3 import Qwen3


class Qwen3Moe(SparseMoE, Qwen3):
    model_types = ("qwen3_moe",)
    # Layer 0 keeps a dense MLP, so both kinds of layer are tested.
    tiny = Tiny(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [0],
            "use_sliding_window": True,
            "sliding_window": 4,
        },
    )
    vllm = replace(Qwen3.vllm, model_types=("qwen3_moe",))
    absent = moe_absent("Qwen3MoeExperts")

    def moe_layer(self, config, layer):
        return (
            layer not in config.mlp_only_layers
            and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0
        )
