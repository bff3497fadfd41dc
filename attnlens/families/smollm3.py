"""SmolLM3: the Llama layout with NoPE layers: where `config.no_rope_layers[i]` is 0 the layer applies no rotary
embedding to its queries and keys.

vLLM runs it through its Transformers backend (transformers' own modules, vLLM's kernel as the attention function).
"""

from ..parts.mirrored import transformers_backend
from .llama import Llama


class SmolLM3(Llama):
    model_types = ("smollm3",)
    tiny = ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0, 1]})  # layer 1 is a NoPE layer
    # vLLM's Transformers backend (tests_vllm), the GLU's gate and up projections fused with the activation
    vllm = transformers_backend(("smollm3",), fused_activation=True)

    kind_notes = {
        "*": dict.fromkeys(
            ("attention_queries", "attention_keys"),
            lambda family, config, layer: None if config.no_rope_layers[layer] else "a NoPE layer: no rotary embedding",
        )
    }
