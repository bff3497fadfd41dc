"""A.X-K2: DeepSeek-V3.2's sparse latent attention with a sigmoid output gate, and gated norms.

One fused projection (`q_gate_proj`, from the query latent and its norm side by side) gives each head its query and a
gate of `v_head_dim` channels; the heads' merged output is multiplied by `sigmoid(gate)` before `o_proj`.
`attention_head_outputs` is the attention function's output before the gate; `attention_gate` is the sigmoid's
output the forward multiplies by, viewed per head, so `head_outputs * gate` merged is the premix and edits of the gate
(in place or assigned) land. `input_layernorm` (and `post_attention_layernorm` on MoE layers) is an RMSNorm times a
sigmoid gate of its own output: the norms' outputs are after that gate.
"""

from ..locations import Derived, Operation, insert_after
from .deepseek_v32 import DeepseekV32


def _per_head(envoy, gate):
    # The forward holds the gate flat, [batch, seq, heads * v_head_dim]; unflatten is a view, so in-place edits land.
    return gate.unflatten(-1, (-1, envoy._module.v_head_dim))


def _flat(envoy, old, new):
    return new.flatten(-2)


class AXK2(DeepseekV32):
    model_types = ("axk2",)
    tiny = ("AXK2Config", "AXK2ForCausalLM", DeepseekV32.tiny[2])

    def locations(self):
        gate = Derived(
            Operation(("torch_sigmoid_0",), anchor="torch.sigmoid(gate_states"),
            _per_head,
            _flat,
            label="attention_gate",
        )
        return insert_after(super().locations(), "attention_head_outputs", "attention_gate", gate)

    kind_notes = {
        "*": {
            "attention_head_outputs": "the mix before the output gate: times attention_gate, merged, is the premix",
            "attention_gate": "sigmoid of each head's gate slice of q_gate_proj, as the forward multiplies the "
            "merged heads by it; a view of that tensor, so in-place edits land, and assignment "
            "lands too",
        }
    }
