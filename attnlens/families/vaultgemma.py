"""VaultGemma: Gemma 2's soft-capped attention and alternating sliding windows, with Gemma's single norm in front of
each sublayer (no norm after attention or the MLP); the MLP's norm is `pre_feedforward_layernorm`.
"""

from dataclasses import replace

from ..family import Tiny
from .gemma2 import Gemma2


class VaultGemma(Gemma2):
    model_types = ("vaultgemma",)
    vllm = replace(Gemma2.vllm, model_types=())
    tiny = Tiny("VaultGemmaConfig", "VaultGemmaForCausalLM", Gemma2.tiny[2])
    attention_post_norm = None
    mlp_post_norm = None
