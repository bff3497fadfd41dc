"""Gemma: the Llama layout; the token embedding module scales by sqrt(hidden) itself."""

from dataclasses import replace

from .llama import Llama


class Gemma(Llama):
    model_types = ("gemma",)
    tiny = ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16})
    vllm = replace(Llama.vllm, model_types=("gemma",))
