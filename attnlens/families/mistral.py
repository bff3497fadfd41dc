"""Mistral: the Llama layout; `config.sliding_window` limits every layer's keys (through the mask only)."""

from dataclasses import replace

from ..family import Tiny
from .llama import Llama


class Mistral(Llama):
    model_types = ("mistral",)
    tiny = Tiny("MistralConfig", "MistralForCausalLM", {"sliding_window": 4})
    vllm = replace(
        Llama.vllm,
        model_types=("mistral",),  # vLLM's MistralForCausalLM is its Llama
    )
