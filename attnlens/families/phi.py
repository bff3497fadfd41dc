"""Phi: a parallel block, partial rotary embedding, a `dense` output projection, optional QK LayerNorm.

Attention and the MLP both read the same `input_layernorm` output, and the block adds both outputs to its input at
once, so there is no residual stream between them (`layer_mid` is unavailable) and no norm in front of the MLP of its
own: `mlp_norm_output` is the shared norm output as the MLP receives it (the MLP module's input, the same tensor as
`attention_norm_output`). Reading it there keeps it in forward order after attention, and assigning it changes only
what the MLP reads. Rotary embedding covers the first `partial_rotary_factor` of each head; with `qk_layernorm`, a
LayerNorm over each head's queries and keys runs before it. The queries and keys are read after both.
"""

from ..family import Family, Tiny
from ..locations import ModuleInput
from ..parts.mirrored import transformers_backend
from ..parts.parallel import PARALLEL_NO_MID, parallel_locations, shared_attention_norm


class Phi(Family):
    model_types = ("phi",)
    vllm = transformers_backend(("phi",))
    tiny = Tiny(
        "PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}, layouts={"qk_layernorm": {"qk_layernorm": True}}
    )
    final_norm = "model.final_layernorm"
    output_projection = "dense"
    activation = "activation_fn"
    down_projection = "fc2"
    absent = {"layer_mid": PARALLEL_NO_MID.format(norms="one shared input_layernorm")}

    def locations(self):
        return parallel_locations(super().locations(), ModuleInput(self.mlp))

    kind_notes = {"*": {"mlp_norm_output": shared_attention_norm}}
