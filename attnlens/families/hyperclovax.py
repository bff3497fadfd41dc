"""HyperCLOVA X: Granite's multipliers (score scale, residual branches, embeddings, logits) with a norm after attention
(`post_norm1`) and after the MLP (`post_norm2`), applied before each scaled residual add:
`layer_mid = layer_input + residual_multiplier * post_norm1(attention_output)`.
"""

from ..family import Tiny
from .granite import Granite


class HyperCLOVAX(Granite):
    model_types = ("hyperclovax",)
    tiny = Tiny("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", Granite.tiny[2])
    attention_post_norm = "post_norm1"
    mlp_post_norm = "post_norm2"

    kind_notes = {
        "*": {
            "layer_mid": "layer_input + residual_multiplier ({config.residual_multiplier:g}) * "
            "post_norm1(attention_output)",
            "layer_output": "layer_mid + residual_multiplier ({config.residual_multiplier:g}) * post_norm2(mlp_output)",
        }
    }
