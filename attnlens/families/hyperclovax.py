"""HyperCLOVA X: Granite's multipliers (score scale, residual branches, embeddings) with a norm after attention
(`post_norm1`) and after the MLP (`post_norm2`), applied before each scaled residual add:
`layer_mid = layer_input + residual_multiplier * post_norm1(attention_output)`. Unlike Granite it multiplies the
logits by `logits_scaling`.

vLLM's HyperCLOVAX blocks pass the residual stream as Granite's do, one tensor, but are called with vLLM's
`(hidden, residual)` pair and return `(layer_output, layer_mid)`: they use only `hidden` (the previous block's
`layer_mid` rides along as `residual`), so `layer_input` is the block's hidden-state argument alone.
"""

from dataclasses import replace

from ..family import Tiny
from ..locations import ModuleArgument
from ..locations.vllm import batched
from .granite import Granite


def _hyperclovax_vllm_locations(family):
    return {**Granite.vllm.locations(family), "layer_input": batched(ModuleArgument("", 1))}


class HyperCLOVAX(Granite):
    model_types = ("hyperclovax",)
    tiny = Tiny("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", Granite.tiny[2])
    attention_post_norm = "post_norm1"
    mlp_post_norm = "post_norm2"
    vllm = replace(Granite.vllm, model_types=("hyperclovax",), locations=_hyperclovax_vllm_locations)

    kind_notes = {
        "*": {
            "layer_mid": "layer_input + residual_multiplier ({config.residual_multiplier:g}) * "
            "post_norm1(attention_output)",
            "layer_output": "layer_mid + residual_multiplier ({config.residual_multiplier:g}) * post_norm2(mlp_output)",
            "logits": "the LM head's output times logits_scaling ({config.logits_scaling:g})",
        }
    }
