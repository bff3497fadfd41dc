"""LFM3: LFM2's hybrid of short convolutions and attention, with sliding-window layers, norms after each sublayer
(`post_operator_norm`, `post_ffn_norm`; the identity without `use_sandwich_norm`), `o_proj` as output projection and,
with `use_attention_gate`, a sigmoid gate per head.

The gate is `sigmoid(g_proj(x))`, one factor per head and position, multiplying each head's output before the merge:
`attention_gate` is it repeated over `head_dim` (a read-only copy: the forward holds one number per head),
`attention_head_outputs` the mix before it. Everything else is LFM2's (transformers 5.24 and later).
"""

from ..family import Tiny, VLLMLayout
from ..locations import Operation, insert_after
from ..parts.gates import repeated_head_gate
from ..parts.vllm import not_in_transformers
from .lfm2 import Lfm2


class Lfm3(Lfm2):
    model_types = ("lfm3",)
    tiny = Tiny(
        "Lfm3Config",
        "Lfm3ForCausalLM",
        {"head_dim": 16, "sliding_window": 4, "layer_types": ["conv", "full_attention", "sliding_attention"]},
        layouts={"no_gate": {"use_attention_gate": False, "use_sandwich_norm": False}},
    )
    vllm = VLLMLayout(refusal=not_in_transformers("LFM3", "Lfm3ForCausalLM", "Lfm3Config", "lfm3"))
    output_projection = "o_proj"
    attention_post_norm = "post_operator_norm"
    mlp_post_norm = "post_ffn_norm"

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"gated"} if config.use_attention_gate and not self.is_mixer_layer(config, layer) else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "gated" not in kind:
            return locations
        gate = repeated_head_gate(Operation(("torch_sigmoid_0",), anchor="torch.sigmoid(self.g_proj(hidden_states))"))
        return insert_after(locations, "attention_head_outputs", "attention_gate", gate)

    kind_notes = {
        "gated": {
            "attention_gate": "sigmoid(g_proj(x)), one per head and position, repeated over head_dim",
            "attention_head_outputs": "the mix before the gate: times attention_gate, merged, is the premix",
        }
    }
