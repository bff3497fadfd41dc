"""Gemma: the Llama layout; the token embedding module scales by sqrt(hidden) itself."""

from ..family import register
from .llama import Llama


@register
class Gemma(Llama):
    model_types = ("gemma",)
    tiny = ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16})
