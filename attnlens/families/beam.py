"""Beam: a sigmoid output gate per head and channel, per-head QK RMSNorm, rotary embedding on sliding layers and
position-dependent query scaling on full ones, norms before and after each sublayer, depth-scaled residual adds, and
mixture-of-experts MLPs where `config.mlp_layer_types` says "sparse".

After the attention function, `sigmoid(gate_proj(x) + gate_bias)` (viewed per head) multiplies each head's output
before the merge: `attention_head_outputs` is the mix before it, `attention_gate` the sigmoid's output (the tensor
the forward multiplies by, so edits land). Full-attention layers rotate nothing and multiply the queries by the
model's `attention_scaling` (a function of position) instead; the queries are read after it. Each sublayer's output is
normalised (`post_attention_layernorm`, `post_feedforward_layernorm`) and added with depth scaling: the `n`-th add of
the network (`2 * (layer + 1)` for attention, one more for the MLP) is `update / sqrt(n) + stream * sqrt((n - 1) / n)`.
"""

import math

from ..family import Family, Tiny, VLLMLayout
from ..locations import Operation, insert_after
from ..parts import identities
from ..parts.moe import SparseMoE, moe_absent
from ..parts.vllm import not_in_transformers


class Beam(SparseMoE, Family):
    model_types = ("beam",)
    vllm = VLLMLayout(refusal=not_in_transformers("Beam", "BeamForCausalLM", "BeamConfig", "beam"))
    tiny = Tiny(
        "BeamConfig",
        "BeamForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "mlp_layer_types": ["dense", "sparse", "dense"],
        },
    )
    mlp_norm = "pre_feedforward_layernorm"
    attention_post_norm = "post_attention_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"
    absent = {**moe_absent("BeamExperts"), "attention_sinks": Family.absent["attention_sinks"]}

    def moe_layer(self, config, layer):
        return config.mlp_layer_types[layer] == "sparse"

    def locations(self):
        gate = Operation(("torch_sigmoid_0",), anchor="torch.sigmoid(gate)")
        return insert_after(super().locations(), "attention_head_outputs", "attention_gate", gate)

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            n = block.attn_residual_add_idx if sublayer == "attention" else block.mlp_residual_add_idx
            return update * (1.0 / math.sqrt(n)) + stream * math.sqrt((n - 1) / n)

    kind_notes = {
        "!sliding_attention": {
            "attention_queries": "RMS-normalised per head (q_norm), not rotated, times the position-dependent "
            "attention_scaling",
            "attention_keys": "RMS-normalised per head (k_norm)",
        },
        "sliding_attention": {
            "attention_queries": "RMS-normalised per head (q_norm), then rotated",
            "attention_keys": "RMS-normalised per head (k_norm), then rotated",
        },
        "*": {
            "attention_head_outputs": "the mix before the output gate: times attention_gate, merged, is the premix",
            "attention_gate": "sigmoid(gate_proj(x) + gate_bias) per head and channel, as the forward multiplies "
            "the heads by it (edits land)",
            "layer_mid": lambda family, config, layer: (
                f"post_attention_layernorm(attention_output) / sqrt({(n := 2 * (layer + 1))}) + layer_input * "
                f"sqrt({n - 1}/{n})"
            ),
            "layer_output": lambda family, config, layer: (
                f"post_feedforward_layernorm(mlp_output) / sqrt({(n := 2 * (layer + 1)) + 1}) + layer_mid * "
                f"sqrt({n}/{n + 1})"
            ),
        },
    }
