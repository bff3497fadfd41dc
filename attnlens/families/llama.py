"""Llama: the common layout (shared attention interface, grouped-query heads, rotary embedding)."""

from ..family import Family, register


@register
class Llama(Family):
    model_types = ("llama",)
    tiny = ("LlamaConfig", "LlamaForCausalLM", {})
    vllm_supported = True  # vLLM keeps these names for Llama and the families built on it here
