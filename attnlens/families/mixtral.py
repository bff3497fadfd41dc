"""Mixtral: Mistral's attention (a sliding window through the mask only) with a sparse mixture-of-experts MLP.

The MLP module (`MixtralSparseMoeBlock`) routes each token to its top-k experts. The experts' weights are stacked in
`mlp.experts` (`MixtralExperts`), whose forward runs one expert at a time on the flattened tokens routed to it, so no
`[batch, seq, intermediate]` activation ever exists: `mlp_activation` and `mlp_neurons` are unavailable, and
`mlp_output` is the block's combined output (the routing-weighted sum of the chosen experts). The router logits are
not part of that output (transformers records them with a hook on the router); where a block returns a tuple,
`mlp_output` is its first item.

`SparseMoE` (moe.py) is the layer kind every MoE family shares. vLLM names the MoE block `block_sparse_moe` (a
`FusedMoE` over the stacked experts); it is renamed `mlp` there too.
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .mistral import Mistral


class Mixtral(SparseMoE, Mistral):
    model_types = ("mixtral",)
    tiny = Tiny(
        "MixtralConfig", "MixtralForCausalLM", {"sliding_window": 4, "num_local_experts": 4, "num_experts_per_tok": 2}
    )
    absent = moe_absent("MixtralExperts")
    vllm = replace(Mistral.vllm, model_types=("mixtral",), names={"mlp": "block_sparse_moe"})
