"""Qwen3.5-MoE: Qwen3.5's hybrid of sigmoid-gated softmax attention and Gated DeltaNet linear attention, with a sparse
mixture-of-experts MLP (routed experts plus a gated shared expert) on every layer.

`Qwen3_5MoeForCausalLM` on a `Qwen3_5MoeTextConfig` ("qwen3_5_moe_text"). No layer has a single activation or neuron
tensor (see Qwen3-Next). Released checkpoints ("qwen3_5_moe", `Qwen3_5MoeForConditionalGeneration`) load as the text
model; the composite object and vLLM's multimodal class are served by `Qwen3_5MoeMultimodal`, as Qwen3.5's are, with
images on the transformers engine (Qwen3.5's tower, layout and M-RoPE: `qwen3_5.Qwen3_5Multimodal`).
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.multimodal import LanguageModelOf
from .qwen3_5 import Qwen3_5Multimodal, multimodal_tiny
from .qwen3_next import Qwen3Next


class Qwen3_5Moe(Qwen3Next):
    model_types = ("qwen3_5_moe_text",)
    # layers 0 and 2 linear attention, layer 1 full attention
    tiny = Tiny(
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "intermediate_size": None,
        },
    )
    label = "Qwen3.5-MoE"
    # vLLM's qwen3_5 (Qwen3_5MoeForCausalLM), as Qwen3.5's (bfloat16, torchvision; values up to 6.6e-2 from
    # transformers' past the Gated DeltaNet layer, and 9.4e-2 at the last MoE layer's output on a CPU with AMX, whose
    # bfloat16 kernels vLLM uses there); full attention on the outer layers. Every token takes every expert: in
    # bfloat16 a near-tied router would pick another expert on each engine.
    vllm = replace(
        Qwen3Next.vllm,
        model_types=("qwen3_5_moe_text",),
        tolerance=1.2e-1,
        tiny={
            "head_dim": 32,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "num_experts_per_tok": 4,
            "layer_types": ["full_attention", "linear_attention", "full_attention"],
        },
    )

    def moe_layer(self, config, layer):
        return True


class Qwen3_5MoeMultimodal(LanguageModelOf, Qwen3_5Moe):
    """Qwen3.5-MoE's composite, with images as Qwen3.5's (`qwen3_5.Qwen3_5Multimodal`: the same tower, image layout
    and interleaved M-RoPE)."""

    model_types = ("qwen3_5_moe",)
    towers = Qwen3_5Multimodal.towers
    images = Qwen3_5Multimodal.images
    kind_notes = Qwen3_5Multimodal.kind_notes
    # vLLM's Qwen3_5MoeForConditionalGeneration
    tiny, vllm = multimodal_tiny("qwen3_5_moe", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", Qwen3_5Moe)
