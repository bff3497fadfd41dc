"""Qwen2: the Llama layout with biased q/k/v projections; sliding windows only where `layer_types` says so.

vLLM's Qwen2 sizes its heads as `hidden_size // num_attention_heads` (whatever `head_dim` says) and refuses, when it
loads, a config that slides on some layers only ("Sliding window for some but all layers is not supported"), so its
tiny checkpoint is 128 wide and slides on every layer.
"""

from dataclasses import replace

from ..family import Tiny
from ..parts import scoring
from .llama import Llama


class Qwen2(Llama):
    model_types = ("qwen2",)
    tiny = Tiny(
        "Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    )
    vllm = replace(
        Llama.vllm,
        model_types=("qwen2",),
        tiny={"hidden_size": 128, "head_dim": 32, "max_window_layers": 0},  # layers from 0 on slide
    )

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            # Qwen2 keeps `sliding_window` in its config even when `use_sliding_window` is off; `layer_types` decides.
            layer_types = getattr(config, "layer_types", None)
            if layer_types is None:
                return config.sliding_window if getattr(config, "use_sliding_window", False) else None
            return config.sliding_window if layer_types[layer] == "sliding_attention" else None
