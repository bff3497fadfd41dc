"""VaultGemma: Gemma 2's soft-capped attention and alternating sliding windows, with Gemma's single norm in front of
each sublayer (no norm after attention or the MLP); the MLP's norm is `pre_feedforward_layernorm`.

vLLM runs it through its Transformers backend (transformers' own modules, vLLM's kernel as the attention function).
"""

from ..parts.mirrored import transformers_backend
from .gemma2 import Gemma2


class VaultGemma(Gemma2):
    model_types = ("vaultgemma",)
    # vLLM's Transformers backend (tests_vllm), the GLU's gate and up projections fused with the activation
    vllm = transformers_backend(("vaultgemma",), fused_activation=True)
    tiny = ("VaultGemmaConfig", "VaultGemmaForCausalLM", Gemma2.tiny[2])
    attention_post_norm = None
    mlp_post_norm = None
