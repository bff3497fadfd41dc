"""MiniCPM3: DeepSeek-V2's multi-head latent attention with a dense MLP, and MiniCPM's three scales.

Each sublayer's output is scaled by `scale_depth / sqrt(num_hidden_layers)` before the residual add, so
`layer_mid = layer_input + s * attention_output` and `layer_output = layer_mid + s * mlp_output`. `embeddings` is the
scaled embedding module's output (times `scale_emb`, what the first block receives), and the final norm's output is
divided by `hidden_size / dim_model_base` before the LM head.
"""

import math

from ..family import Tiny
from .deepseek_v2 import LatentAttention
from .youtu import LATENT_TINY


class MiniCPM3(LatentAttention):
    model_types = ("minicpm3",)
    # scales far from 1, so a family ignoring one fails the identities
    tiny = Tiny("MiniCPM3Config", "MiniCPM3ForCausalLM", {**LATENT_TINY, "scale_depth": 0.5, "dim_model_base": 16})

    def residual_add(self, block, sublayer, stream, update):
        return stream + update * block.residual_scale

    def notes(self, config, layer, engine="transformers"):
        scale = config.scale_depth / math.sqrt(config.num_hidden_layers)
        return {**super().notes(config, layer, engine),
                "layer_mid": f"layer_input + {scale:g} * attention_output (scale_depth / sqrt(num_hidden_layers))",
                "layer_output": f"layer_mid + {scale:g} * mlp_output (scale_depth / sqrt(num_hidden_layers))",
                "embeddings": f"the scaled embedding's output: token embeddings times scale_emb ({config.scale_emb:g})",
                "logits": f"the LM head applied to final_norm_output / {config.hidden_size / config.dim_model_base:g} "
                          f"(hidden_size / dim_model_base)"}
