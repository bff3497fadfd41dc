"""Gemma: the Llama layout; the token embedding module scales by sqrt(hidden) itself."""

from dataclasses import replace

from ..family import Tiny
from .llama import Llama


class Gemma(Llama):
    model_types = ("gemma",)
    tiny = Tiny("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16})
    vllm = replace(Llama.vllm, model_types=("gemma",))
