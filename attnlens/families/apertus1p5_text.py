"""Apertus 1.5's text model: Apertus's block and attention unchanged (transformers 5.24 and later)."""

from ..family import Tiny, VLLMLayout
from ..parts.vllm import not_in_transformers
from .apertus import Apertus


class Apertus1p5Text(Apertus):
    model_types = ("apertus1p5_text",)
    tiny = Tiny("Apertus1p5TextConfig", "Apertus1p5TextForCausalLM", {})
    vllm = VLLMLayout(
        refusal=not_in_transformers(
            "Apertus 1.5", "Apertus1p5TextForCausalLM", "Apertus1p5TextConfig", "apertus1p5_text"
        )
    )
