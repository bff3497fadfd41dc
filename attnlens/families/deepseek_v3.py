"""DeepSeek-V3: DeepSeek-V2's latent attention and dense-then-MoE MLP; sigmoid routing, optionally interleaved rope.

Nothing a standardized value depends on differs from DeepSeek-V2: the rotary embedding (interleaved or not) is
applied before the keys are expanded, and the routing only decides which experts run.
"""

from .deepseek_v2 import DeepseekV2


class DeepseekV3(DeepseekV2):
    model_types = ("deepseek_v3",)
    tiny = ("DeepseekV3Config", "DeepseekV3ForCausalLM", {**DeepseekV2.tiny[2], "n_group": 1, "topk_group": 1})
    # yarn-scaled rope with mscale_all_dim: the score scale is no longer qk_head_dim ** -0.5.
    tiny_layouts = {"yarn": {"rope_interleave": False, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}}}
