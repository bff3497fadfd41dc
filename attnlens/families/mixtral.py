"""Mixtral: Mistral's attention (a sliding window through the mask only) with a sparse mixture-of-experts MLP.

The MLP module (`MixtralSparseMoeBlock`) routes each token to its top-k experts. The experts' weights are stacked in
`mlp.experts` (`MixtralExperts`), whose forward runs one expert at a time on the flattened tokens routed to it, so no
`[batch, seq, intermediate]` activation ever exists: `mlp_activation` and `mlp_neurons` are unavailable, and
`mlp_output` is the block's combined output (the routing-weighted sum of the chosen experts). The router logits are
not part of that output (transformers records them with a hook on the router); where a block returns a tuple,
`mlp_output` is its first item.

`SparseMoE` is the mixin the other MoE families (Qwen2-MoE, Qwen3-MoE) reuse.
"""

from __future__ import annotations

from functools import cached_property

from ..family import Family, register
from ..locations import ModuleOutput
from .mistral import Mistral

#: Values a sparse MoE block never forms as one tensor.
PER_EXPERT = ("mlp_activation", "mlp_neurons")


def moe_absent(experts_class: str, extra: str = "") -> dict[str, str]:
    """The reasons `mlp_activation` and `mlp_neurons` are missing on a sparse MoE layer."""
    reason = (f"a sparse mixture of experts: no [batch, seq, intermediate] tensor exists. Each expert's "
              f"act_fn(gate) * up is formed per expert, only for the tokens routed to it, inside mlp.experts "
              f"({experts_class}.forward, one expert at a time over the flattened tokens); mlp_output is the "
              f"routing-weighted sum of the chosen experts{extra}")
    return {**Family.absent, **{name: reason for name in PER_EXPERT}}


class SparseMoE:
    """Mixin for families whose MLP is a sparse mixture of experts on the layers `moe_layer` names (every layer
    unless overridden); set `absent` with `moe_absent`."""

    def moe_layer(self, config, layer: int) -> bool:
        return True

    def locations(self):
        # The block's output, or item 0 where a transformers version returns (output, router_logits).
        return {**super().locations(), "mlp_output": ModuleOutput("", 0)}

    @cached_property
    def _moe_locations(self):
        return {name: location for name, location in self._locations.items() if name not in PER_EXPERT}

    def locations_for(self, config, layer):
        if layer is not None and self.moe_layer(config, layer):
            return self._moe_locations
        return super().locations_for(config, layer)

    def vllm_unavailable(self, config, layer):
        # vLLM's fused-activation reason is about a dense MLP; on a MoE layer the experts' reason stands.
        reasons = super().vllm_unavailable(config, layer)
        return {k: v for k, v in reasons.items() if k not in PER_EXPERT} if self.moe_layer(config, layer) else reasons


@register
class Mixtral(SparseMoE, Mistral):
    model_types = ("mixtral",)
    tiny = ("MixtralConfig", "MixtralForCausalLM",
            {"sliding_window": 4, "num_local_experts": 4, "num_experts_per_tok": 2})
    absent = moe_absent("MixtralExperts")
