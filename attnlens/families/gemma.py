"""Gemma: the Llama layout; the token embedding module scales by sqrt(hidden) itself."""

from .llama import Llama


class Gemma(Llama):
    model_types = ("gemma",)
    tiny = ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16})
    vllm_model_types = ("gemma",)
