"""Sarvam-MLA: DeepSeek-V3 itself (transformers builds `DeepseekV3ForCausalLM` from its config); nothing differs.

vLLM 0.32 registers SarvamMLAForCausalLM (DeepSeek-V2's latent attention wrapper), but cannot read a sarvam_mla
config: it ships no config class for the type and the transformers it pins has none (measured).
"""

from ..family import Tiny, VLLMLayout
from .deepseek_v3 import DeepseekV3


class SarvamMLA(DeepseekV3):
    model_types = ("sarvam_mla",)
    tiny = Tiny("SarvamMLAConfig", "DeepseekV3ForCausalLM", DeepseekV3.tiny[2])
    vllm = VLLMLayout(
        refusal="vLLM 0.32 registers SarvamMLAForCausalLM but cannot read a sarvam_mla config: it ships no config "
        'class for the type, and the transformers it pins (<5.20; 5.19 here) has no SarvamMLAConfig ("The checkpoint '
        'you are trying to load has model type `sarvam_mla` but Transformers does not recognize this architecture"); '
        "the transformers engine serves the family"
    )
