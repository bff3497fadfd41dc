"""Apertus: the Llama layout under other norm names (`attention_layernorm`, `feedforward_layernorm`), a per-head
RMSNorm on queries and keys before the rotary embedding, and a non-gated MLP (`down_proj(xielu(up_proj(x)))`).
"""

from ..family import Tiny
from .llama import Llama


class Apertus(Llama):
    model_types = ("apertus",)
    tiny = Tiny("ApertusConfig", "ApertusForCausalLM", {})
    attention_norm = "attention_layernorm"
    mlp_norm = "feedforward_layernorm"

    def notes(self, config, layer, engine="transformers"):
        return {**super().notes(config, layer, engine),
                "attention_queries": "RMS-normalised per head (q_norm), then rotated",
                "attention_keys": "RMS-normalised per head (k_norm), then rotated",
                "mlp_neurons": "what down_proj receives: the activation of up_proj(x), no gate"}
