"""GLM-MoE-DSA (GLM-5): DeepSeek-V3.2's sparse latent attention, where some layers reuse the previous layer's choice.

Layers marked "shared" in `config.indexer_types` have no indexer (`self_attn.indexer` is None): they mask with the
top-k keys the previous indexed layer chose for each query. Everything else is DeepSeek-V3.2's.
"""

from dataclasses import replace

from ..family import Tiny
from .deepseek_v32 import DSA_REFUSAL, DeepseekV32


class GlmMoeDsa(DeepseekV32):
    model_types = ("glm_moe_dsa",)
    vllm = replace(DeepseekV32.vllm, refusal=DSA_REFUSAL)  # vLLM runs it through DeepSeek-V3.2's sparse attention
    tiny = Tiny(
        "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {**DeepseekV32.tiny[2], "indexer_types": ["full", "shared", "full"]}
    )

    def indexer_note(self, config, layer):
        note = super().indexer_note(config, layer)
        types = getattr(config, "indexer_types", None)
        if types and types[layer] == "shared":
            note = note.replace(
                "self_attn.indexer chooses",
                "the previous indexed layer's indexer chose (this layer has none: indexer_types[layer] is 'shared')",
            )
        return note
