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

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..family import Tiny, released_tiny
from ..parts.multimodal import LanguageModelOf, Tower, released_vllm
from .qwen2_vl import POSITIONS_NOTE, TOKENS, QwenImages
from .qwen3_next import Qwen3Next
from .vision_qwen3_5 import Qwen3_5VisionTower

#: A one-block vision tower projecting to the tiny text width, for the released checkpoints' recipes: patches of 16
#: pixels (two frames each), merged 2 x 2, learned positions on a 48 x 48 grid resampled to each image's (the config's
#: defaults but for the sizes).
VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64}
#: The tiny composites' text config past the text family's: the image tokens' ids (`qwen2_vl.TOKENS`, past the
#: character tokenizer's 128), and 32-wide heads whose rotary quarter (8 dimensions, 4 frequencies) takes M-RoPE's
#: three sections interleaved: frequencies 0 and 3 the temporal id, 1 the row, 2 the column (as released: 64 rotary
#: dimensions in sections 11, 11, 10).
MULTIMODAL_TEXT = {
    "vocab_size": 132,
    "head_dim": 32,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}


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


class Qwen3_5Images(QwenImages):
    """Qwen2-VL's layout (`QwenImages`): image `i` is `image_grid_thw[i]` = (t, h, w) patches merged
    `spatial_merge_size` on h and w, (h / m) x (w / m) `image_token_id` tokens row-major between
    `vision_start_token_id` and `vision_end_token_id`; they attend causally, as text does."""

    def tiny_processor(self, config, char_tokenizer):
        """Qwen3-VL's processor (the one transformers maps Qwen3.5 to) on the PIL image processor at the tower's
        patch and merge sizes; no video processor (transformers' needs torchvision, which attnlens does not
        install): the processor takes images and text, and refuses videos."""
        from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

        class ImagesOnly(Qwen3VLProcessor):
            def check_argument_for_proper_class(self, argument_name, argument):
                if argument_name == "video_processor" and argument is None:
                    return None  # (looking the class up imports torchvision)
                return super().check_argument_for_proper_class(argument_name, argument)

        names = {"video_token": "<|video_pad|>", "image_token": "<|image_pad|>"}
        names |= {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
        ids = {name: getattr(config, f"{name}_id") for name in names}
        tokenizer = char_tokenizer(min(ids.values()), extra={names[n]: i for n, i in ids.items()}, named=names)
        vision = config.vision_config
        images = Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
            size={"shortest_edge": (vision.patch_size * vision.spatial_merge_size) ** 2, "longest_edge": 256 * 256},
        )
        return ImagesOnly(image_processor=images, tokenizer=tokenizer, video_processor=None)


def multimodal_tiny(model_type: str, config: str, model: str, text: type) -> tuple[Tiny, Any]:
    """The tiny recipe of a released Qwen3.5 (-MoE) composite, `released_tiny` with the image tokens and M-RoPE
    sections of `MULTIMODAL_TEXT`, and its vLLM layout (`released_vllm`) on the text config without them: the text
    model vLLM's tests run (`language_model_only`) stays the one their tolerances and tokens were measured on."""
    recipe = released_tiny(config, model, text, VISION)
    text_config = {**recipe.kwargs["text_config"], **MULTIMODAL_TEXT}
    with_images = recipe._replace(kwargs={**recipe.kwargs, **TOKENS, "text_config": text_config})
    return with_images, released_vllm(text, model_type, recipe)


class Qwen3_5Multimodal(LanguageModelOf, Qwen3_5):
    """The composite (`Qwen3_5ForConditionalGeneration`), with images: Qwen3.5's ViT as `model.vision`
    (`Qwen3_5VisionTower`), its merger's output in the image tokens' rows of what the first language-model layer
    reads (nothing else of the tower reaches the language model: no deepstack). The language model rotates its
    full-attention layers' queries and keys by interleaved M-RoPE: each token's (temporal, row, column) ids
    (`model.model.get_rope_index`, from `mm_token_type_ids` and `image_grid_thw`) rotate the rotary frequencies in
    turn (frequency `f` by the row id where `f % 3 == 1`, the column id where `f % 3 == 2`, within
    `mrope_section`'s counts, the temporal id otherwise); text ids are equal and count on, an image's take its grid
    (offset by its start), the text after an image counts on from its start plus max(h, w) / m. The queries and keys
    read are after the rotation, so the score function (scaled products, causal mask) holds on image prompts. The
    Gated DeltaNet layers have no attention weights (Qwen3-Next's values there), and no positions: they read the
    sequence in order, image tokens as any."""

    model_types = ("qwen3_5",)
    towers = {"vision": Tower("model.visual", Qwen3_5VisionTower, inputs=("pixel_values",))}
    images = Qwen3_5Images()
    kind_notes = {"!mixer": {"attention_key_positions": POSITIONS_NOTE}}
    # vLLM's Qwen3_5ForConditionalGeneration; its qwen3_5 module imports qwen3_vl's, which imports torchvision
    tiny, vllm = multimodal_tiny("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", Qwen3_5)
