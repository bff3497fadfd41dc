"""Sarvam-MLA: DeepSeek-V3 itself (transformers builds `DeepseekV3ForCausalLM` from its config); nothing differs."""

from ..family import Tiny
from .deepseek_v3 import DeepseekV3


class SarvamMLA(DeepseekV3):
    model_types = ("sarvam_mla",)
    tiny = Tiny("SarvamMLAConfig", "DeepseekV3ForCausalLM", DeepseekV3.tiny[2])
