"""Granite MoE Shared: Granite's multipliers, a mixture of experts in every block (`block_sparse_moe`, renamed `mlp`),
and a shared MLP beside it.

Both the routed experts and `shared_mlp` read `post_attention_layernorm`'s output, and the block adds their outputs
itself before scaling by `residual_multiplier`: `layer_output = layer_mid + residual_multiplier * (experts +
shared_mlp)`. No module returns that sum, so where the shared MLP exists (`shared_intermediate_size > 0`)
`mlp_output` is unavailable; without it, `mlp_output` is the experts' output. The experts apply their gated activation
to their routed tokens only, so no activation or neuron tensor exists.
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .granite import Granite

SHARED = (
    "the MLP's output is block_sparse_moe's output plus shared_mlp's, summed in the block itself (no module "
    "returns it): layer_output - layer_mid is residual_multiplier times it"
)


class GraniteMoeShared(SparseMoE, Granite):
    model_types = ("granitemoeshared",)
    tiny = Tiny(
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        {**Granite.tiny[2], "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32},
        layouts={"no_shared_mlp": {"shared_intermediate_size": 0}},
    )
    mlp = "block_sparse_moe"
    absent = moe_absent("GraniteMoeSharedExperts")
    vllm = replace(
        Granite.vllm,
        model_types=("granitemoeshared",),
        tiny={"hidden_size": 128},  # vLLM's head size is hidden_size // num_attention_heads
    )

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"shared"} if config.shared_intermediate_size else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        return {n: loc for n, loc in locations.items() if n != "mlp_output"} if "shared" in kind else locations

    kind_reasons = {"shared": {"mlp_output": SHARED}}

    kind_notes = {
        "shared": {
            "mlp_input": "what the routed experts receive; shared_mlp receives the same tensor",
            "layer_output": "layer_mid + residual_multiplier ({config.residual_multiplier:g}) * (experts + shared_mlp)",
        }
    }
