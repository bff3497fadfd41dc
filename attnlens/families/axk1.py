"""A.X-K1: DeepSeek-V3 with a norm on the MoE block's output (`mlp.post_mlp_layernorm`), inside the MLP module, so
`mlp_output` on MoE layers is that norm's output: the routed experts plus the shared expert, normalised."""

from ..family import Tiny
from .deepseek_v3 import DeepseekV3


class AXK1(DeepseekV3):
    model_types = ("axk1",)
    tiny = Tiny("AXK1Config", "AXK1ForCausalLM", DeepseekV3.tiny[2])

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if self.moe_layer(config, layer):
            notes["mlp_output"] = "mlp.post_mlp_layernorm(routed experts + shared expert): the MoE block's own norm"
        return notes
