"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): Qwen2's
language model under `model.language_model` beside Qwen's ViT under `model.visual` (`model.vision`,
`families.vision.QwenVisionTower`).

A prompt holds an image as `image_token_id` tokens between `vision_start_token_id` and `vision_end_token_id`: the
tower's patches merged `spatial_merge_size` x `spatial_merge_size` into one token, so the image `i` with grid
`image_grid_thw[i] = (t, h, w)` (in patches) is `t * (h / m) * (w / m)` tokens, row-major over a `h / m` x `w / m` grid
(`QwenImages`). A video is `video_token_id` tokens between the same two: `video_grid_thw[j] = (t, h, w)`, t frames
(temporal patches of `temporal_patch_size` frames) one after another, each a `h / m` x `w / m` grid, a view of the
video in `model.positions`. Image and video tokens attend causally, as text does (the model's mask is the causal
one). The tower runs on the images (`pixel_values`), then again on the videos (`pixel_values_videos`), each frame
attending within itself (its own segment of `cu_seqlens`; Qwen2.5-VL's windows within it); `model.vision` serves the
first run: the images', the videos' on a prompt without images.

Positions: the language model rotates its queries and keys by multimodal rotary positions (M-RoPE): each token has a
(temporal, row, column) position id from `model.model.get_rope_index(...)`, its head dimensions split in three
sections (`rope_parameters["mrope_section"]`) rotated by one of the three. A text token's three ids are equal and
count on from the last one before it; an image's tokens share a temporal id and take their row and column in the grid
(offset by where the image starts), and the text after an image goes on from its start plus `max(h, w) / m`, not its
token count. A video's frame `f` takes the temporal id start + f * interval (1 on Qwen2-VL; on Qwen2.5-VL
`tokens_per_second * second_per_grid_ts`), and the text after it goes on from its start plus `max(h, w) / m` too.
The queries and keys attnlens reads are after the rotation (the model's own), so the score function (the plain scaled
products, causal mask) holds on image and video prompts; `attention_key_positions` stays what it is everywhere: each
key's index in the sequence, which is not its rotary position after an image.

The model computes its M-RoPE ids only where it is given `mm_token_type_ids` (the processor's: 1 on image tokens, 2
on video tokens) with `image_grid_thw` (`video_grid_thw`); pass them as the processor returns them. vLLM (its qwen2_vl
and qwen2_5_vl classes) computes the same M-RoPE ids from the image's grid: its values with an image equal
transformers' (tests_vllm/test_images.py); with a video they have not been compared.
"""

from __future__ import annotations

from dataclasses import replace

from ..family import TINY_DEFAULTS, Tiny
from ..parts.multimodal import ImageTokens, LanguageModelOf, Tower, released_vllm
from .qwen2 import Qwen2
from .vision import Qwen2_5VisionTower, QwenVisionTower

POSITIONS_NOTE = (
    "each key's index in the sequence (0..seq-1 on a prefill), not its rotary position: this model rotates queries "
    "and keys by 3-D M-RoPE ids (temporal, row, column: model.model.get_rope_index), under which an image's tokens "
    "share a temporal id and take their grid row and column, and text after an image counts on from max(h, w) / "
    "spatial_merge_size past the image's start"
)


class QwenImages(ImageTokens):
    """Image `i` is `image_grid_thw[i]` = (t, h, w) patches, merged `spatial_merge_size` on h and w: a grid of
    (h / m) x (w / m) tokens (an image has t = 1). Video `j` is `video_grid_thw[j]` = (t, h, w): t frames (temporal
    patches, each `temporal_patch_size` frames of the video), each a view of (h / m) x (w / m) tokens, frame after
    frame under `video_token_id`."""

    video_token = "video_token_id"
    around = ("vision_start_token_id", "vision_end_token_id")

    @staticmethod
    def _thw(config, inputs, name: str, index: int) -> tuple[int, int, int]:
        grids = inputs.get(name)
        if grids is None:
            raise ValueError(f"the grid of a Qwen-VL {name.split('_')[0]} is its {name} row: pass {name}")
        if index >= len(grids):
            raise ValueError(f"input_ids hold more {name.split('_')[0]}s than {name} gives ({len(grids)} rows)")
        t, h, w = (int(n) for n in grids[index])
        merge = config.vision_config.spatial_merge_size
        return t, h // merge, w // merge

    def grid(self, config, inputs, image):
        t, rows, cols = self._thw(config, inputs, "image_grid_thw", image)
        if t != 1:
            raise ValueError(
                f"image {image} has t = {t} in image_grid_thw: an image is one frame; pass frames as a video "
                f"(pixel_values_videos, video_grid_thw)"
            )
        return rows, cols

    def video_grid(self, config, inputs, video):
        t, rows, cols = self._thw(config, inputs, "video_grid_thw", video)
        return t, (rows, cols)


def _text(vocab: int = 132) -> dict:
    """The tiny text config: Qwen2's sizes, 16-wide heads split (2, 3, 3) over M-RoPE's three sections."""
    return {
        **TINY_DEFAULTS,
        "vocab_size": vocab,  # the image tokens past the character tokenizer's 128 ids
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }


def _vllm_text(model_type: str) -> dict:
    """The tiny text config vLLM's CPU kernels take: 32-wide heads (the width over the heads: Qwen2-VL's text
    config has no head_dim), M-RoPE's sections over their 16 frequencies."""
    text = _text()
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [4, 6, 6]}
    return {"model_type": model_type, **text, "num_attention_heads": 2, "num_key_value_heads": 1}


#: What the tower runs on: images, videos (each a run of its own: `QwenVisionTower.segments`).
VISUAL_INPUTS = ("pixel_values", "pixel_values_videos")
#: The image and special tokens of the tiny recipes (outside the character tokenizer's ids).
TOKENS = {"video_token_id": 128, "image_token_id": 129, "vision_start_token_id": 130, "vision_end_token_id": 131}


class Qwen2VL(LanguageModelOf, Qwen2):
    model_types = ("qwen2_vl",)
    towers = {"vision": Tower("model.visual", QwenVisionTower, inputs=VISUAL_INPUTS)}
    images = QwenImages()
    kind_notes = {"*": {"attention_key_positions": POSITIONS_NOTE}}
    tiny = Tiny(
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        {
            "text_config": {"model_type": "qwen2_vl_text", **_text()},
            **TOKENS,
            "vision_config": {
                "depth": 2,
                "embed_dim": 32,
                "num_heads": 2,
                "mlp_ratio": 2,
                "patch_size": 8,
                "temporal_patch_size": 2,
                "spatial_merge_size": 2,
                "hidden_size": 64,  # the merger's output: the language model's width
            },
        },
    )
    vllm = replace(released_vllm(Qwen2, "qwen2_vl", tiny), tiny={"text_config": _vllm_text("qwen2_vl_text")})


class Qwen2_5VL(Qwen2VL):
    model_types = ("qwen2_5_vl",)
    towers = {"vision": Tower("model.visual", Qwen2_5VisionTower, inputs=VISUAL_INPUTS)}
    tiny = Tiny(
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        {
            "text_config": {"model_type": "qwen2_5_vl_text", **_text()},
            **TOKENS,
            "vision_config": {
                "depth": 3,
                "hidden_size": 32,
                "num_heads": 2,
                "intermediate_size": 48,
                "patch_size": 8,
                "temporal_patch_size": 2,
                "spatial_merge_size": 2,
                "window_size": 32,  # windows of 2 x 2 merged tokens: 16 patches
                "fullatt_block_indexes": [1],  # blocks 0 and 2 attend within windows, block 1 within each image
                "out_hidden_size": 64,
            },
        },
    )
    vllm = replace(Qwen2VL.vllm, model_types=("qwen2_5_vl",), tiny={"text_config": _vllm_text("qwen2_5_vl_text")})
