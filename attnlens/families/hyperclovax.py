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

    def notes(self, config, layer, engine="transformers"):
        r = config.residual_multiplier
        return {
            **super().notes(config, layer, engine),
            "layer_mid": f"layer_input + residual_multiplier ({r:g}) * post_norm1(attention_output)",
            "layer_output": f"layer_mid + residual_multiplier ({r:g}) * post_norm2(mlp_output)",
        }
