"""Bamba: Mamba-2 layers with attention layers at `config.attn_layer_indices`, Jamba's block names.

Every block has `input_layernorm` in front of its mixer and `pre_ff_layernorm` in front of the gated MLP
(`feed_forward`, renamed `mlp`). Attention layers run the common attention; the others a Mamba-2 mixer (`mamba`,
renamed `self_attn`, see `families/hybrid.py`).
"""

from ..family import Family, Tiny, VLLMLayout
from ..parts.mixers import MixerLayers
from ..parts.vllm import backend_refuses, no_dispatch


class Bamba(MixerLayers, Family):
    model_types = ("bamba",)
    vllm = VLLMLayout(
        refusal=backend_refuses(
            "Bamba",
            no_dispatch("0 (linear_attention)"),
            ("BambaForCausalLM", "0.23.0"),
        )
    )
    tiny = Tiny(
        "BambaConfig",
        "BambaForCausalLM",
        {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "attn_layer_indices": [1]},
    )
    final_norm = "model.final_layernorm"
    mlp = "feed_forward"
    mlp_norm = "pre_ff_layernorm"
    mixer_kind = (
        "a Mamba-2 layer: a selective state-space scan over a recurrent state, gated and RMS-normalised before out_proj"
    )

    def is_mixer_layer(self, config, layer):
        return layer not in config.attn_layer_indices
