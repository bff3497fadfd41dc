"""A.X-K2: DeepSeek-V3.2's sparse latent attention with a sigmoid output gate, and gated norms.

One fused projection (`q_gate_proj`, from the query latent and its norm side by side) gives each head its query and a
gate of `v_head_dim` channels; the heads' merged output is multiplied by `sigmoid(gate)` before `o_proj`.
`attention_head_outputs` is the attention function's output before the gate; `attention_gate` is the sigmoid's
output the forward multiplies by, viewed per head, so `head_outputs * gate` merged is the premix and edits of the gate
(in place or assigned) land. `input_layernorm` (and `post_attention_layernorm` on MoE layers) is an RMSNorm times a
sigmoid gate of its own output: the norms' outputs are after that gate.
"""

from ..family import VLLMLayout
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
    vllm = VLLMLayout(
        refusal="vLLM 0.32 has no class for AXK2ForCausalLM (it registers AXK1ForCausalLM only); its Transformers "
        'backend takes AXK2Attention for dense latent attention ("Fused: self_attn (AXK2Attention) -> '
        'MLAAttention"), whose attention function (vllm_mla_attention_forward) drops the mask that carries the '
        "indexer's top-k choice, and on CPU does not run the tiny checkpoint: in float32 its MLA kernel says "
        '"expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4)", in bfloat16 '
        '(enforce_eager) "Head dimension 64 is not supported by MLA."; the transformers engine serves the family'
    )

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
