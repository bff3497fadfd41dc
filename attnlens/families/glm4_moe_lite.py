"""GLM-4-MoE-Lite: DeepSeek-V3's latent attention and dense-then-MoE MLP (`config.mlp_layer_types`); nothing a
standardized value depends on differs."""

from ..family import Tiny
from .deepseek_v3 import DeepseekV3


class Glm4MoeLite(DeepseekV3):
    model_types = ("glm4_moe_lite",)
    tiny = Tiny("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", DeepseekV3.tiny[2])
