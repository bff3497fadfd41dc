"""Bamba: Mamba-2 layers with attention layers at `config.attn_layer_indices`, Jamba's block names.

Every block has `input_layernorm` in front of its mixer and `pre_ff_layernorm` in front of the gated MLP
(`feed_forward`, renamed `mlp`). Attention layers run the common attention; the others a Mamba-2 mixer (`mamba`,
renamed `self_attn`, see `families/hybrid.py`).
"""

from ..family import Family, Tiny
from ..parts.mixers import MixerLayers


class Bamba(MixerLayers, Family):
    model_types = ("bamba",)
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
