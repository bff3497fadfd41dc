"""OLMo 2: no norm in front of attention or the MLP; RMSNorms after each (before the residual add), and QK-norm over
the whole projection.

`q_norm`/`k_norm` normalise the full q/k projections (all heads together, `num_heads * head_dim` wide) before the
head split and the rotary embedding. Attention reads the residual stream itself, so `attention_norm_output` does not
exist; `layer_mid` is `layer_input + post_attention_layernorm(attention_output)` and is the MLP's input (there is no
norm in front of the MLP either, so `mlp_norm_output` does not exist); `layer_output` is
`layer_mid + post_feedforward_layernorm(mlp_output)`.
"""

from ..family import Tiny
from ..locations import ModuleInput
from ..parts.mirrored import transformers_backend
from .llama import Llama

#: Why a block with norms after its sublayers only (OLMo 2, EXAONE 4) has no pre-sublayer norm outputs.
NO_PRE_NORMS = {
    "attention_norm_output": "no norm in front of attention: the attention reads the residual stream (layer_input) "
    "itself; post_attention_layernorm normalises its output instead",
    "mlp_norm_output": "no norm in front of the MLP: the MLP reads the residual stream (layer_mid) itself; "
    "post_feedforward_layernorm normalises its output instead",
}


class Olmo2(Llama):
    model_types = ("olmo2",)
    vllm = transformers_backend(("olmo2",), fused_activation=True)
    tiny = Tiny("Olmo2Config", "Olmo2ForCausalLM", {})
    attention_norm = None
    mlp_norm = None
    attention_post_norm = "post_attention_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"
    absent = {**Llama.absent, **NO_PRE_NORMS}

    def locations(self):
        locations = super().locations()
        del locations["attention_norm_output"], locations["mlp_norm_output"]
        # The MLP's input is the residual stream after attention: one tensor, two names.
        return {**locations, "layer_mid": ModuleInput(self.mlp)}

    kind_notes = {
        "*": {
            "attention_queries": "RMS-normalised over all heads together (q_norm over num_heads * head_dim) "
            "before the head split, then rotated",
            "attention_keys": "RMS-normalised over all key/value heads together (k_norm) before the head split, "
            "then rotated",
            "mlp_input": "the same tensor as layer_mid: no norm in front of the MLP",
            "layer_output": "layer_mid + post_feedforward_layernorm(mlp_output): a norm follows the MLP",
        }
    }
