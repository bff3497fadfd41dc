"""Sparse mixture-of-experts MLPs: the layer kind every MoE family shares.

A routed MoE block sends each token to its top-k experts, and each expert applies its activation to its own tokens
only (inside the experts module, one expert at a time over the flattened tokens), so no `[batch, seq, intermediate]`
activation or neuron tensor exists on those layers: `mlp_activation` and `mlp_neurons` are unavailable there, and
`mlp_output` is the block's combined output (the routing-weighted sum of the chosen experts, plus any shared expert).
Where a block returns `(output, router logits)`, `mlp_output` is its first item.
"""

from __future__ import annotations

from ..locations import ModuleOutput

#: Values a sparse MoE block never forms as one tensor.
PER_EXPERT = ("mlp_activation", "mlp_neurons")


def moe_absent(experts: str, extra: str = "") -> dict[str, str]:
    """The reasons `mlp_activation` and `mlp_neurons` are missing on a sparse MoE layer, naming the experts' module
    (`extra` adds what else joins the output)."""
    reason = (
        f"a sparse mixture of experts: no [batch, seq, intermediate] tensor exists. Each expert's "
        f"act_fn(gate) * up is formed per expert, only for the tokens routed to it, inside mlp.experts "
        f"({experts}.forward, one expert at a time over the flattened tokens); mlp_output is the "
        f"routing-weighted sum of the chosen experts{extra}"
    )
    return dict.fromkeys(PER_EXPERT, reason)


class SparseMoE:
    """Mixin for a family whose MLP is a sparse mixture of experts on the layers `moe_layer` names (every layer
    unless overridden): those layers are of kind "moe". Set `absent` with `moe_absent`."""

    def moe_layer(self, config, layer: int) -> bool:
        return True

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"moe"} if self.moe_layer(config, layer) else kind

    def locations(self):
        return {**super().locations(), "mlp_output": ModuleOutput("", 0)}

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "moe" in kind:
            locations = {name: location for name, location in locations.items() if name not in PER_EXPERT}
        return locations
