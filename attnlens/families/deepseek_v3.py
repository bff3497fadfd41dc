"""DeepSeek-V3: DeepSeek-V2's latent attention and dense-then-MoE MLP; sigmoid routing, optionally interleaved rope.

Nothing a standardized value depends on differs from DeepSeek-V2: the rotary embedding (interleaved or not) is
applied before the keys are expanded, and the routing only decides which experts run. With `rope_interleave` (the
default) transformers de-interleaves the rotary channels before rotating them (even channels, then odd ones), and
stores queries and keys in that order; vLLM rotates the interleaved pairs in place, so on vLLM the rotary channels
are served in transformers' order (`deinterleaved_rope`). vLLM reads no `rope_interleave`: without it transformers
rotates the halves (rotate_half) while vLLM still rotates interleaved pairs, another function.
"""

from dataclasses import replace

from ..family import Joined, Tiny
from .deepseek_v2 import DeepseekV2

#: DeepSeek-V3's yarn rope, scaled to the tiny context.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def _vllm_rotary_order(family, config, layer) -> str:
    if family.deinterleaved_rope(config):
        return (
            "rotary channels in transformers' order (the even ones, then the odd ones: transformers "
            "de-interleaves them before rotating; vLLM rotates interleaved pairs in place)"
        )
    return (
        "vLLM reads no rope_interleave: it rotates interleaved pairs where transformers (rope_interleave "
        "False) rotates the halves, so its queries and keys, and the pattern, differ from transformers'"
    )


class DeepseekV3(DeepseekV2):
    model_types = ("deepseek_v3",)
    tiny = Tiny(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**DeepseekV2.tiny[2], "n_group": 1, "topk_group": 1},
        layouts={"yarn": {"rope_interleave": False, "rope_parameters": YARN}},
    )
    # yarn-scaled rope with mscale_all_dim: the score scale is no longer qk_head_dim ** -0.5.
    # vLLM's DeepSeek-V3 routes only with noaux_tc and sigmoid scores; a yarn rope, as the released checkpoints
    # have, keeps vLLM's CPU rotary kernel out (mla.cpu_rope_fault).
    vllm = replace(
        DeepseekV2.vllm,
        model_types=("deepseek_v3",),
        tiny={**DeepseekV2.vllm.tiny, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_parameters": YARN},
    )

    def deinterleaved_rope(self, config) -> bool:
        """Whether transformers stores the rotary channels de-interleaved (`attnlens.locations.latent`)."""
        return bool(getattr(config, "rope_interleave", True))

    kind_notes = {"vllm": dict.fromkeys(("attention_queries", "attention_keys"), Joined(_vllm_rotary_order))}
