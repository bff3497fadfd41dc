"""GLM-4-MoE: the Llama layout (no post-norms, unlike GLM-4) with partial rotary embedding, optional per-head QK-norm,
and, from layer `first_k_dense_replace` on, a sparse mixture-of-experts MLP with shared experts.

The rotary embedding turns only the first `partial_rotary_factor` of each head's dimensions (in halves, not GLM-4's
interleaved pairs); with `use_qk_norm` an RMSNorm over each head's queries and keys runs before it. The queries and
keys are read after both. On MoE layers `mlp_output` is the routing-weighted sum of the chosen experts (sigmoid
scores, grouped top-k) plus the shared experts' output; the first `first_k_dense_replace` layers keep a dense MLP.
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .llama import Llama


def rotary_note(family, config, layer) -> str:
    factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
    if factor == 1:
        return "rotated over every dimension of the head"
    return f"rotated on the first {factor:g} of each head's dimensions; the rest unrotated"


class Glm4Moe(SparseMoE, Llama):
    model_types = ("glm4_moe",)
    # Layer 0 keeps a dense MLP, so both kinds of layer are tested.
    tiny = Tiny(
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "use_qk_norm": True,
        },
    )
    absent = moe_absent(
        "Glm4MoeExperts", ", plus the shared experts (mlp.shared_experts, a dense MLP reading the same input)"
    )
    vllm = replace(Llama.vllm, model_types=("glm4_moe",))

    def moe_layer(self, config, layer):
        return layer >= config.first_k_dense_replace

    kind_notes = {"*": {"attention_queries": rotary_note, "attention_keys": rotary_note}}
