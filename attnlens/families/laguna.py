"""Laguna: AFMoE-style attention (per-head QK RMSNorm, rotary, sliding windows per `config.layer_types`) with a softplus
output gate, a head count per layer, and mixture-of-experts MLPs where `config.mlp_layer_types` says "sparse".

After the attention function, `g_proj(x)` goes through `softplus` (not a sigmoid) and multiplies the merged heads:
with `gating` per head (the default) one factor per head, repeated over its `head_dim`; with `gating="per-element"`
one per channel. `attention_gate` is that factor per head and channel (per head: a read-only copy, the forward holding
one number per head; per element: a view of the forward's tensor, so edits land); `attention_head_outputs` is the mix
before it, and `head_outputs * gate`, merged, the premix. Each layer has `num_attention_heads_per_layer[i]` query
heads.
"""

from ..family import Family, Tiny
from ..locations import Operation, insert_after
from ..locations.views import per_head
from ..parts.gates import repeated_head_gate
from ..parts.moe import SparseMoE, moe_absent
from ..parts.sizes import Sizes


class Laguna(SparseMoE, Family):
    model_types = ("laguna",)
    tiny = Tiny("LagunaConfig", "LagunaForCausalLM", {
        "head_dim": 16, "sliding_window": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "num_attention_heads_per_layer": [4, 8, 4], "mlp_layer_types": ["dense", "sparse", "sparse"]}, layouts={"per_element_gate": {"gating": "per-element"}})
    absent = {**moe_absent("LagunaExperts"), "attention_sinks": Family.absent["attention_sinks"]}
    sizes = Sizes(num_heads=("num_heads",))

    @staticmethod
    def per_head(config) -> bool:
        return config.gating is True or config.gating == "per-head"

    def moe_layer(self, config, layer):
        return config.mlp_layer_types[layer] == "sparse"

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"gate_per_head"} if self.per_head(config) else kind

    def kind_locations(self, kind, config, engine):
        source = Operation(("gate_0",), anchor="F.softplus(")
        gate = repeated_head_gate(source) if "gate_per_head" in kind else per_head(source, label="attention_gate")
        locations = super().kind_locations(kind, config, engine)
        return insert_after(locations, "attention_head_outputs", "attention_gate", gate)

    def notes(self, config, layer, engine="transformers"):
        shape = "one per head, repeated over head_dim (a read-only copy)" if self.per_head(config) else \
            "one per channel (a view: edits land)"
        return {**super().notes(config, layer, engine),
                "attention_queries": "RMS-normalised per head (q_norm), then rotated",
                "attention_keys": "RMS-normalised per head (k_norm), then rotated",
                "attention_head_outputs": "the mix before the output gate: times attention_gate, merged, is the "
                                          "premix",
                "attention_gate": f"softplus(g_proj(x)), not a sigmoid: {shape}"}
