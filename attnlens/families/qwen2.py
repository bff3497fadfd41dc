"""Qwen2: the Llama layout with biased q/k/v projections; sliding windows only where `layer_types` says so."""

from .llama import Llama


class Qwen2(Llama):
    model_types = ("qwen2",)
    tiny = ("Qwen2Config", "Qwen2ForCausalLM",
            {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1})
    vllm_model_types = ("qwen2",)
    vllm_tiny = {"hidden_size": 128, "head_dim": 32, "max_window_layers": 0}

    def sliding_window(self, config, layer):
        # Qwen2 keeps `sliding_window` in its config even when `use_sliding_window` is off; `layer_types` decides.
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            return config.sliding_window if getattr(config, "use_sliding_window", False) else None
        return config.sliding_window if layer_types[layer] == "sliding_attention" else None
