"""Apertus: the Llama layout under other norm names (`attention_layernorm`, `feedforward_layernorm`), a per-head
RMSNorm on queries and keys before the rotary embedding, and a non-gated MLP (`down_proj(xielu(up_proj(x)))`).
"""

from dataclasses import replace

from ..locations import ModuleOutput, insert_after
from ..locations.vllm import batched
from .llama import Llama


def _apertus_vllm_locations(family):
    return insert_after(
        Llama.vllm.locations(family), "mlp_input", "mlp_activation", batched(ModuleOutput(family.activation))
    )


class Apertus(Llama):
    model_types = ("apertus",)
    tiny = ("ApertusConfig", "ApertusForCausalLM", {})
    attention_norm = "attention_layernorm"
    mlp_norm = "feedforward_layernorm"
    # vLLM (apertus.py): the same names, vLLM's (hidden, residual) pair, an XIELU module per MLP. vLLM keeps xIELU's
    # constants in bfloat16 (transformers in float32): 1.3e-3 apart at mlp_activation, 1.5e-3 at mlp_output (tiny).
    vllm = replace(Llama.vllm, model_types=("apertus",), tolerance=2e-3, locations=_apertus_vllm_locations)

    kind_notes = {
        "*": {
            "attention_queries": "RMS-normalised per head (q_norm), then rotated",
            "attention_keys": "RMS-normalised per head (k_norm), then rotated",
            "mlp_neurons": "what down_proj receives: the activation of up_proj(x), no gate",
        }
    }
