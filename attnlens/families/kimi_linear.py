"""Kimi Linear: a hybrid of Kimi Delta Attention (KDA) linear-attention layers and NoPE latent-attention layers, with
DeepSeek-V3's dense-then-MoE MLP (`config.mlp_layer_types`).

Layers with `config.layer_types[i] == "full_attention"` are DeepSeek-V2's multi-head latent attention without any
rotary embedding: the `qk_rope_head_dim` slice of every key is the latent's shared slice, unrotated. The other layers
are KDA (`self_attn` too): a recurrent state updated by a gated delta rule with a channel-wise forget gate, read out,
RMS-normed and gated (`o_norm`) per head before `o_proj`; they form no query-key pattern, so there `self_attn`
serves only what it has: its output and what `o_proj` receives (`attention_premix`), with the linear heads' sizes.
"""

from dataclasses import replace

from ..family import Joined, Tiny
from ..parts.mixers import LinearLayers
from .deepseek_v2 import DeepseekV2, LatentAttention
from .youtu import LATENT_TINY

MOE = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "mlp_layer_types": ["dense", "sparse", "dense"],
}


class DeltaHybrid(LinearLayers):
    """Mixin for a family whose `linear_attention` layers are Kimi Delta Attention modules under `self_attn`."""

    label = "Kimi Linear"
    sizes = replace(
        LatentAttention.sizes,
        head_dim=("v_head_dim", "head_dim"),
        qk_head_dim=("qk_head_dim", "head_dim"),
        scale=("scaling", lambda module, found: module.head_dim**-0.5),
    )

    # sizes: a KDA module's heads are its linear heads (its premix merges them)

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        if self.is_mixer_layer(config, layer):
            why = (
                f"layer {layer} of {self.label} is a Kimi Delta Attention linear-attention layer: a recurrent state "
                f"updated by a gated delta rule with a channel-wise forget gate; its queries, keys and values "
                f"(convolved, L2-normalised inside the kernel) write and read that state, and no query-key softmax "
                f"pattern, per-head mix of values or sink exists. attention_premix is its readout, RMS-normed and "
                f"gated per head (o_norm), merged"
            )
            reasons.update(dict.fromkeys(self.mixer_lacks, why))
        return reasons

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if self.is_mixer_layer(config, layer):
            return {
                "attention_premix": f"what self_attn.o_proj receives: each of the {config.linear_num_heads} "
                f"linear heads' readout of the recurrent state, RMS-normed and gated by "
                f"o_norm, merged; the envoy's num_heads and head_dim are the linear heads'",
                "attention_output": "the Kimi Delta Attention layer's output (no softmax)",
            }
        return notes


class KimiLinear(DeltaHybrid, DeepseekV2):
    model_types = ("kimi_linear",)
    tiny = Tiny(
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        {
            **LATENT_TINY,
            **MOE,
            "q_lora_rank": None,
            "linear_head_dim": 16,
            "linear_num_heads": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        },
    )

    kind_notes = {
        "!mixer": {
            "attention_keys": Joined("no rotary embedding (NoPE): the shared slice is unrotated"),
            "attention_queries": "no rotary embedding (NoPE)",
        }
    }
