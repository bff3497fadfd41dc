"""GLM-4-MoE-Lite (GLM-4.7-Flash): DeepSeek-V3's latent attention and dense-then-MoE MLP (`config.mlp_layer_types`);
nothing a standardized value depends on differs.

vLLM's implementation (model_executor/models/glm4_moe_lite.py) builds DeepSeek-V2's MLA attention classes, with the
kernel at `self_attn.mla_attn.mla_attn`, so the values are read there as on DeepSeek-V3 (`attnlens/vllm/mla.py`).
"""

from dataclasses import replace

from .deepseek_v3 import DeepseekV3


class Glm4MoeLite(DeepseekV3):
    model_types = ("glm4_moe_lite",)
    tiny = ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", DeepseekV3.tiny[2])
    tiny_layouts = {}  # the score scale under yarn is DeepSeek-V3's, tested there
    vllm = replace(DeepseekV3.vllm, model_types=("glm4_moe_lite",))
