"""OLMo 3: OLMo 2 with sliding-window layers: `config.layer_types` names each layer's attention, and a
"sliding_attention" layer sees its last `config.sliding_window` keys (through the mask, and its own rotary
parameters)."""

from dataclasses import replace

from ..family import Tiny
from .olmo2 import Olmo2


class Olmo3(Olmo2):
    model_types = ("olmo3",)
    vllm = replace(
        Olmo2.vllm,
        model_types=("olmo3",),  # vLLM's Transformers backend
    )
    tiny = Tiny(
        "Olmo3Config",
        "Olmo3ForCausalLM",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    )
