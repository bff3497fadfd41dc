"""LightOnOCR ("lighton_ocr", `LightOnOcrForConditionalGeneration`: LightOnOCR-1B, -2): a Pixtral vision tower, a
patch merger and projector, a Qwen3 language model.

transformers 5.25 holds the tower at `model.vision_encoder` (a `PixtralVisionModel`: every image at its own size, one
sequence of their patches, a 2-D rotary, a block-diagonal mask over images; `PixtralTower` serves it as
`model.vision`), the projector at `model.vision_projection` (RMSNorm, then the patch merger: each
`spatial_merge_size` x `spatial_merge_size` block of an image's patch grid concatenated and mixed by
`merging_layer`, then two linear layers), and the language model at `model.language_model` (a `Qwen3Model`), the head
at `lm_head` (tied to the embeddings): Qwen3's family through `LanguageModelOf` serves the language model.

How a prompt holds an image (the LightOnOCR processor): the image is resized to fit `longest_edge`, its sides rounded
up to `patch_size * spatial_merge_size` (`image_sizes` gives each image's size in pixels); its grid is that size over
`patch_size * spatial_merge_size`, and the prompt holds it as ONE run of rows x columns `image_token_id` tokens,
row-major, with no break or end tokens between rows (unlike Pixtral's processor; the tokenizer names [IMG_BREAK] and
[IMG_END] but the processor does not put them in). The features are the tower's last hidden state (the last block's
output: the config has no `vision_feature_layer`). The image tokens attend causally, as text does: the mask is the
text model's.
"""

from __future__ import annotations

from ..family import TINY_DEFAULTS, Tiny
from ..parts.multimodal import ImageTokens, LanguageModelOf, Tower
from ..parts.vllm import VLLMLayout
from .mistral3 import TINY_IMAGE, TOWER
from .qwen3 import Qwen3
from .vision_pixtral import PixtralImages, PixtralTower


class LightOnOcrTower(PixtralTower):
    """Pixtral's tower as LightOnOCR reads it: the projector takes the last block's output."""

    kind_notes = {
        "*": {
            **PixtralTower.kind_notes["*"],
            "layer_output": "the projector reads the tower's last hidden state: the last block's layer_output",
        }
    }


class LightOnOcrImages(PixtralImages):
    """The LightOnOCR processor's layout: an image is its grid of merged patches (`image_sizes` over `patch_size *
    spatial_merge_size`, which the model needs), one run of `image_token_id` tokens row-major, nothing between rows."""

    def __init__(self) -> None:
        super().__init__(needs_sizes=True)

    def positions(self, config, input_ids, inputs):
        return ImageTokens.positions(self, config, input_ids, inputs)  # no break tokens to place, as Pixtral's has

    def tiny_processor(self, config, char_tokenizer):
        from transformers import PixtralImageProcessorPil
        from transformers.models.lighton_ocr.processing_lighton_ocr import LightOnOcrProcessor

        # the processor reads the break and end tokens' names and ids from the tokenizer, though it puts none in
        names = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
        at = dict(zip(names.values(), range(config.image_token_id, config.image_token_id + 3)))
        tokenizer = char_tokenizer(config.image_token_id, extra=at, named=names)
        vision, merge = config.vision_config, config.spatial_merge_size
        step = {"height": vision.patch_size * merge, "width": vision.patch_size * merge}
        images = PixtralImageProcessorPil(size={"longest_edge": vision.image_size}, patch_size=step)
        return LightOnOcrProcessor(
            image_processor=images, tokenizer=tokenizer, patch_size=vision.patch_size, spatial_merge_size=merge
        )


class LightOnOcr(LanguageModelOf, Qwen3):
    """LightOnOCR: Pixtral's tower as `model.vision`, a Qwen3 language model whose image tokens attend causally;
    `model.positions` places each image token on its image's merged grid."""

    model_types = ("lighton_ocr",)
    towers = {"vision": Tower("model.vision_encoder", LightOnOcrTower)}
    images = LightOnOcrImages()
    vllm = VLLMLayout(refusal="attnlens has not compared LightOnOCR's language model on vLLM with transformers")
    tiny = Tiny(
        "LightOnOcrConfig",
        "LightOnOcrForConditionalGeneration",
        {
            "text_config": {"model_type": "qwen3", **TINY_DEFAULTS, "head_dim": 16, "vocab_size": 132},
            "image_token_id": TINY_IMAGE,
            "vision_config": TOWER,
        },
    )
    kind_notes = {
        "*": {
            "attention_probabilities": "image tokens attend causally, as text does: LightOnOCR's mask is its text "
            "model's",
        }
    }

    built_of = {"text": ("qwen3",), "vision": ("pixtral",)}
