"""Phi-3: one fused `qkv_proj` split into [queries | keys | values] along its output, a fused `gate_up_proj` MLP, and
an optional sliding window (`config.sliding_window`, through the mask only).

The queries and keys are read after the rotary embedding (new tensors); the values are a slice of `qkv_proj`'s output
viewed per head, so an in-place edit of them writes into that output, which nothing else reads. The MLP computes
`gate, up = gate_up_proj(x).chunk(2)` and `up * activation_fn(gate)`: `mlp_activation` is `activation_fn(gate)` and
`mlp_neurons` is the product the down projection receives; neither the gate nor the up projection alone is a value.
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.fused import FusedQKV
from .llama import Llama


class Phi3(Llama):
    model_types = ("phi3",)
    tiny = Tiny("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 4})
    vllm = replace(
        Llama.vllm,
        model_types=("phi3",),  # vLLM's Phi3ForCausalLM is its Llama, loading the fused projections as they are
    )
    activation = "activation_fn"
    fused_qkv = FusedQKV("qkv_proj", "blocks")

    kind_notes = {
        "*": {
            "mlp_activation": "activation_fn(gate), gate the first half of the fused gate_up_proj output",
            "mlp_neurons": "up * activation_fn(gate), up the second half of the fused gate_up_proj output",
        }
    }
