"""Apertus: the Llama layout under other norm names (`attention_layernorm`, `feedforward_layernorm`), a per-head
RMSNorm on queries and keys before the rotary embedding, and a non-gated MLP (`down_proj(xielu(up_proj(x)))`).
"""

from ..locations import ModuleOutput, insert_after
from ..vllm.locations import batched
from .llama import Llama


class Apertus(Llama):
    model_types = ("apertus",)
    tiny = ("ApertusConfig", "ApertusForCausalLM", {})
    attention_norm = "attention_layernorm"
    mlp_norm = "feedforward_layernorm"
    # vLLM (apertus.py): the same names, vLLM's (hidden, residual) pair, an XIELU module per MLP. vLLM keeps xIELU's
    # constants in bfloat16 (transformers in float32): 1.3e-3 apart at mlp_activation, 1.5e-3 at mlp_output (tiny).
    vllm_model_types = ("apertus",)
    vllm_tolerance = 2e-3

    def vllm_locations(self):
        return insert_after(super().vllm_locations(), "mlp_input", "mlp_activation",
                            batched(ModuleOutput(self.activation)))

    def notes(self, config, layer, engine="eager"):
        return {**super().notes(config, layer, engine),
                "attention_queries": "RMS-normalised per head (q_norm), then rotated",
                "attention_keys": "RMS-normalised per head (k_norm), then rotated",
                "mlp_neurons": "what down_proj receives: the activation of up_proj(x), no gate"}
