"""GraniteMoE: Granite's four multipliers with a sparse mixture-of-experts MLP (`block_sparse_moe`) on every layer.

The MoE block routes each token to its top-k experts (moe.py); `mlp_output` is the routing-weighted sum, which the
block scales by `residual_multiplier` before the residual add, as Granite's does. vLLM's GraniteMoE passes one tensor
between blocks like vLLM's Granite (granite.py).
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .granite import Granite


class GraniteMoe(SparseMoE, Granite):
    model_types = ("granitemoe",)
    tiny = Tiny(
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        {**Granite.tiny[2], "num_local_experts": 4, "num_experts_per_tok": 2},
    )
    mlp = "block_sparse_moe"
    absent = moe_absent("GraniteMoeExperts")
    vllm = replace(
        Granite.vllm,
        model_types=("granitemoe",),
        tiny={"hidden_size": 128},  # vLLM's head size is hidden_size // num_attention_heads
    )
