"""LFM2: short gated convolutions with a few attention layers among them, under Liquid's names.

Every block normalises with `operator_norm` in front of its token mixer and `ffn_norm` in front of the MLP
(`feed_forward`, renamed `mlp`). Layers whose `config.layer_types` entry is `"conv"` mix tokens with `conv`
(renamed `self_attn`, see `families/hybrid.py`): `in_proj` gives B, C and x, and the output is `C * conv(B * x)`, a
depthwise causal convolution over `conv_L_cache` tokens. The others run the common attention with a per-head RMSNorm
on queries and keys (`q_layernorm`, `k_layernorm`) before the rotary embedding, and `out_proj` as output projection.
The MLP is `w2(silu(w1(x)) * w3(x))`, its activation a function call, not a module: `mlp_activation` is that call's
output (`F_silu_0`), `mlp_neurons` what `w2` receives. The final norm is named `embedding_norm`.
"""

import torch.nn.functional as F

from ..family import Family, MLPArithmetic, Tiny
from ..locations import Operation
from ..parts.mixers import MixerLayers


class Lfm2(MixerLayers, Family):
    model_types = ("lfm2",)
    tiny = Tiny("Lfm2Config", "Lfm2ForCausalLM", {"layer_types": ["conv", "full_attention", "conv"]})
    final_norm = "model.embedding_norm"
    attention_norm = "operator_norm"
    mlp_norm = "ffn_norm"
    mlp = "feed_forward"
    output_projection = "out_proj"
    down_projection = "w2"
    mixer = "conv"
    mixer_kind = "a short gated convolution: C * conv(B * x), depthwise and causal over conv_L_cache tokens"
    mixer_premix = "what its out_proj receives is the gated convolution's output, not attention heads merged"

    def locations(self):
        return {**super().locations(), "mlp_activation": Operation(("F_silu_0",), anchor="F.silu(self.w1(x))")}

    def mlp_arithmetic(self, mlp):
        return MLPArithmetic(lambda neurons: mlp.w2(neurons), lambda x: mlp.w1(x), F.silu,
                             lambda x, activation: activation * mlp.w3(x),
                             says=("w1(mlp input)", "activation * w3(mlp input)", "w2(neurons)"))

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if not self.is_mixer_layer(config, layer):
            notes["attention_queries"] = "RMS-normalised per head (q_layernorm), then rotated"
            notes["attention_keys"] = "RMS-normalised per head (k_layernorm), then rotated"
        notes["mlp_activation"] = "F.silu(w1(x)), a function call inside the MLP's forward"
        notes["mlp_neurons"] = "what w2 receives: silu(w1(x)) * w3(x)"
        return notes
