"""MiniCPM5-MoE: Llama's attention with a sigmoid output gate per head and channel, and DeepSeek-V3's dense-then-MoE
MLP (`config.mlp_layer_types`).

One fused projection, `q_gate_proj`, gives each head its query and a gate of `head_dim` channels side by side
(`chunk(2)` of each head's `2 * head_dim` slice). The attention function's output is merged, then multiplied by
`gate_states.sigmoid()` before `o_proj`: `attention_head_outputs` is the attention function's output, before the
gate; `attention_gate` is that sigmoid's output (the tensor the forward multiplies by, held flat as
`[batch, seq, heads * head_dim]`), viewed per head, so `head_outputs * gate`, merged, is the premix and edits of the
gate (in place or assigned) land. Queries and keys are rotated over all of `head_dim` (no QK-norm, no partial
rotary); `heads * head_dim` need not be `hidden_size` (the released checkpoint: 32 heads of 128 on 2048).

Layers whose `config.mlp_layer_types` entry is "sparse" (all but the first `first_k_dense_replace`, one by default)
are DeepSeek-V3's MoE: sigmoid router scores, experts chosen by score + `e_score_correction_bias` (grouped top-k),
their scores renormalised (`norm_topk_prob`) and times `routed_scaling_factor`, plus the shared experts' dense MLP on
the same input; no activation or neuron tensor exists there. The "dense" layers keep a plain gated MLP.
"""

from ..family import Family, Tiny, VLLMLayout
from ..locations import Operation, insert_after
from ..locations.views import per_head
from ..parts.moe import SparseMoE, moe_absent
from ..parts.vllm import not_in_transformers


def _moe_output(family, config, layer) -> str:
    kept = "renormalised" if config.norm_topk_prob else "not renormalised"
    return (
        "the routing-weighted sum of the chosen experts (sigmoid router scores; experts chosen by score + "
        f"e_score_correction_bias, grouped top-k; their scores {kept}, times routed_scaling_factor="
        f"{config.routed_scaling_factor:g}) plus the shared experts' MLP (mlp.shared_experts) on the same input"
    )


class MiniCPM5Moe(SparseMoE, Family):
    model_types = ("minicpm5_moe",)
    # head_dim 32 on hidden_size 64 with four heads: the heads' width is not hidden_size, as on the released model.
    # A dense layer after a sparse one: the kind is read from mlp_layer_types, not a dense prefix.
    tiny = Tiny(
        "MiniCPM5MoeConfig",
        "MiniCPM5MoeForCausalLM",
        {
            "head_dim": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "mlp_layer_types": ["dense", "sparse", "dense"],
        },
    )
    absent = moe_absent(
        "MiniCPM5MoeExperts", ", plus the shared experts (mlp.shared_experts, a dense MLP reading the same input)"
    )
    vllm = VLLMLayout(
        refusal=not_in_transformers("MiniCPM5 MoE", "MiniCPM5MoeForCausalLM", "MiniCPM5MoeConfig", "minicpm5_moe")
    )

    def moe_layer(self, config, layer):
        return config.mlp_layer_types[layer] == "sparse"

    def locations(self):
        # the forward holds the sigmoid flat, [batch, seq, heads * head_dim]: split per head, a view, so edits land
        gate = per_head(Operation(("gate_states_sigmoid_0",), anchor="gate_states.sigmoid()"), label="attention_gate")
        return insert_after(super().locations(), "attention_head_outputs", "attention_gate", gate)

    kind_notes = {
        "*": {
            "attention_queries": "the first head_dim channels of each head's q_gate_proj slice, rotated",
            "attention_head_outputs": "the mix before the output gate: times attention_gate, merged, is the premix",
            "attention_gate": "sigmoid of the last head_dim channels of each head's q_gate_proj slice, as the "
            "forward multiplies the merged heads by it; a view of that tensor, so in-place edits land, and "
            "assignment lands too",
        },
        "moe": {"mlp_output": _moe_output},
    }
