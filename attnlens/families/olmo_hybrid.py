"""OLMo Hybrid: OLMo 2's attention blocks among Gated DeltaNet linear-attention blocks of the Llama layout.

The two kinds of block differ in more than the mixer. Attention blocks (`config.layer_types` "full_attention") are
OLMo 2's: no norm in front of attention or the MLP, RMSNorms after each (`post_attention_layernorm`,
`post_feedforward_layernorm`), QK-norm over the whole projections, and a rotary embedding unless the model runs
without one. Linear-attention blocks normalise in front instead (`input_layernorm`, then `post_attention_layernorm`
in front of the MLP) and mix tokens with a Gated DeltaNet (`linear_attn`, renamed `self_attn`): a recurrent state
updated by a gated delta rule, with no queries-keys pattern (see `families/hybrid.py`). `residual_add` applies the
post-norms where the block has them.
"""

from ..family import Family, Tiny
from ..parts.mixers import NO_SOFTMAX, MixerLayers
from .olmo2 import Olmo2


class OlmoHybrid(MixerLayers, Olmo2):
    model_types = ("olmo_hybrid",)
    tiny = Tiny("OlmoHybridConfig", "OlmoHybridForCausalLM", {
        "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention", "linear_attention"]})
    # the linear-attention blocks' norms (OLMo 2's attention blocks have neither: its locations drop them)
    attention_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"
    attention_post_norm = None  # only attention blocks have them: see residual_add
    mlp_post_norm = None
    mixer = "linear_attn"
    mixer_kind = "a Gated DeltaNet linear-attention layer: a recurrent state updated by a gated delta rule"
    mixer_premix = ("what its out_proj receives is each head's readout of the state, RMS-normalised and gated by "
                    "silu(z), not attention heads merged")

    def kind_locations(self, kind, config, engine):
        if "mixer" not in kind or engine != "transformers":
            return super().kind_locations(kind, config, engine)
        common = Family.locations(self)  # the Llama block
        return {name: location for name, location in common.items() if name not in NO_SOFTMAX}

    def residual_add(self, block, sublayer, stream, update):
        if not hasattr(block, "post_feedforward_layernorm"):  # a linear-attention block: pre-norm
            return stream + update
        norm = block.post_attention_layernorm if sublayer == "attention" else block.post_feedforward_layernorm
        return stream + norm(update)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if self.is_mixer_layer(config, layer):
            for name in ("mlp_input", "layer_output"):
                notes.pop(name, None)  # OLMo 2's notes describe the attention blocks
            notes["layer_mid"] = "layer_input + attention_output (this block normalises in front, not after)"
        else:
            notes["layer_mid"] = "layer_input + post_attention_layernorm(attention_output): a norm follows attention"
        return notes
