"""Qwen3.5: Qwen3-Next's hybrid of sigmoid-gated softmax attention and Gated DeltaNet linear attention, with a dense
MLP on every layer.

The text model is `Qwen3_5ForCausalLM` on a `Qwen3_5TextConfig` (`model_type` "qwen3_5_text"). Full-attention layers
gate their heads by `sigmoid(gate)` exactly as Qwen3-Next does; by default every fourth layer is full attention
(`full_attention_interval`), the rest linear attention (see Qwen3-Next).

Released checkpoints are "qwen3_5" (`Qwen3_5ForConditionalGeneration`: a `text_config` and a `vision_config`).
Loaded from the checkpoint, transformers builds the text model (`AutoModelForCausalLM` maps the type to
`Qwen3_5ForCausalLM` on the text config, the vision tower's weights dropped), served by this family; the composite
handed over as an object, and the checkpoint on vLLM (its multimodal class, the same text class as `language_model`),
are served by `Qwen3_5Multimodal`, the text model under `language_model` (`multimodal.LanguageModelOf`).
"""

from dataclasses import replace

from ..family import Tiny, released_tiny
from ..parts.multimodal import LanguageModelOf, released_vllm
from .qwen3_next import Qwen3Next

#: A one-block vision tower projecting to the tiny text width, for the released checkpoints' recipes.
VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64}


class Qwen3_5(Qwen3Next):
    model_types = ("qwen3_5_text",)
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
    # which imports torchvision (make install-vllm).
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


class Qwen3_5Multimodal(LanguageModelOf, Qwen3_5):
    model_types = ("qwen3_5",)
    tiny = released_tiny("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", Qwen3_5, VISION)
    vllm = released_vllm(Qwen3_5, "qwen3_5", tiny)  # vLLM's Qwen3_5ForConditionalGeneration
