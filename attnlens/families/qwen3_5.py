"""Qwen3.5 (text): Qwen3-Next's hybrid of sigmoid-gated softmax attention and Gated DeltaNet linear attention, with a
dense MLP on every layer.

The text model is `Qwen3_5ForCausalLM` on a `Qwen3_5TextConfig` (`model_type` "qwen3_5_text"); a full Qwen3.5
checkpoint ("qwen3_5", with a `text_config`) loads as the same class through `AutoModelForCausalLM`, so both types
map here. Full-attention layers gate their heads by `sigmoid(gate)` exactly as Qwen3-Next does; by default every
fourth layer is full attention (`full_attention_interval`), the rest linear attention (see Qwen3-Next).
"""

from dataclasses import replace

from ..family import Tiny
from .qwen3_next import Qwen3Next


class Qwen3_5(Qwen3Next):
    model_types = ("qwen3_5_text", "qwen3_5")
    # full_attention_interval=3: layers 0 and 1 are linear attention, layer 2 full attention.
    tiny = Tiny(
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        {
            "head_dim": 16,
            "full_attention_interval": 3,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_conv_kernel_dim": 4,
        },
    )
    label = "Qwen3.5"
    # vLLM's qwen3_5 (Qwen3_5ForCausalLM): Qwen3-Next's classes, bfloat16 only on CPU. Its module imports qwen3_vl,
    # which imports torchvision (make install-vllm). A full "qwen3_5" checkpoint runs there as the multimodal
    # Qwen3_5ForConditionalGeneration (language_model.model.*), where transformers builds Qwen3_5ForCausalLM (model.*):
    # one family has one set of eager paths, so only the text type is served.
    vllm = replace(
        Qwen3Next.vllm,
        model_types=("qwen3_5_text",),
        tolerance=8e-2,
        tiny={
            "head_dim": 32,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "layer_types": ["full_attention", "linear_attention", "full_attention"],
        },
    )
    # bfloat16 on both engines: from the Gated DeltaNet layer on, values are up to 6.4e-2 (relative, mlp_output) from
    # transformers' on the tiny checkpoint (5.1e-2 at that layer's output: vLLM's CPU kernel accumulates the recurrent
    # state in another order), past one bf16 step

    def moe_layer(self, config, layer):
        return False
