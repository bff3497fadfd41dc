"""Pixtral's vision tower (`PixtralVisionModel`: Mistral 3's, and Pixtral-12B's inside LLaVA), served as the vision
stack `model.vision.layers[i]` of the multimodal model that holds it (`parts.multimodal.Tower`).

The tower reads each image at its own size: `patch_conv` embeds the padded batch, each image's patch grid is cut to
its `image_sizes` (pixels over `patch_size`), and the grids are flattened row-major and concatenated into ONE sequence
with a batch axis of one ([1, patches of every image, hidden]), normed by `ln_pre`. Its blocks are Mistral's: RMSNorm
`attention_norm`, attention (`q_proj`, `k_proj`, `v_proj`, transformers' attention interface, `o_proj`), the residual
add, RMSNorm `ffn_norm`, a gated MLP `feed_forward` (`gate_proj`, `up_proj`, `act_fn`, `down_proj`), the residual add.
Queries and keys are rotated by a 2-D rotary (`patch_positional_embedding`: half the frequencies by the patch's row in
its image, half by its column), and the mask handed to the attention is block-diagonal (`generate_block_attention_mask`:
the dtype's minimum between images), so each patch attends to every patch of its own image and to none of another.
On eager that is one softmax over the whole sequence, the mask added to the scores: the pattern is one tensor, exact
zeros off each image's block.
"""

from __future__ import annotations

import sys
import types

from ..family import Family
from ..locations import INTERFACE_CALL, ModuleInput, ModuleOutput, softmax_argument
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts.multimodal import KINDS, ImageTokens
from ..parts.sizes import Sizes
from ..parts.vllm import VLLMLayout
from .vision import QwenVisionTower

#: `Positions.kind` of the tokens the processor puts after an image's rows.
SPECIAL = KINDS.index("special")
PIXTRAL_LAYOUT = (
    "one sequence of every image's patches, batch axis of one: each image's patch grid (its image_sizes over "
    "patch_size) row-major, images one after another"
)


def patch_grids(config, inputs: dict) -> list[tuple[int, int]]:
    """(rows, columns) of patches of each image the tower reads, from the `image_sizes` given (pixels), else every
    image the padded `pixel_values`' full size, as `PixtralVisionModel` cuts them. `config`: the tower's."""
    sizes = inputs.get("image_sizes")
    if sizes is None:
        pixels = inputs["pixel_values"]
        sizes = [tuple(pixels.shape[-2:])] * pixels.shape[0]
    return [(int(height) // config.patch_size, int(width) // config.patch_size) for height, width in sizes]


class PixtralTower(Family):
    """Pixtral's vision tower (`PixtralVisionModel`), as a stack of a multimodal model: every image's patches one
    sequence of batch one, a 2-D rotary, a block-diagonal mask over images (the module docstring)."""

    layers = "transformer.layers"
    embed_tokens = "ln_pre"
    final_norm = None
    attention = "attention"
    mlp = "feed_forward"
    attention_norm = "attention_norm"
    mlp_norm = "ffn_norm"
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_heads",), head_dim=("head_dim",), scale=("scaling",))
    vllm = VLLMLayout(refusal="attnlens reads vision towers on the transformers engine only")
    absent = {
        **Family.absent,
        "final_norm_output": "Pixtral's tower ends at its last block: a norm after it (Mistral 3's) is the projector's",
    }

    class ScoreFunction(QwenVisionTower.ScoreFunction):
        """Every patch sees every patch of its own image (`image_of`: the image of each patch, `segments`)."""

        def beyond_queries_and_keys(self, config, layer):
            return (
                "the tower's mask is block-diagonal over its images (from image_sizes), which the queries and keys do "
                "not give"
            )

    def segments(self, config, inputs: dict, layer: int):
        """[1, patches]: the image each patch of the tower's sequence is in (every block attends within images), from
        the `image_sizes` given, as the tower builds its block-diagonal mask; the score function's `image_of`."""
        import torch

        counts = torch.tensor([rows * cols for rows, cols in patch_grids(config, inputs)])
        return torch.repeat_interleave(torch.arange(len(counts)), counts)[None]

    def locations(self):
        found = {
            **super().locations(),
            "embeddings": ModuleInput(self.embed_tokens),
            # the eager function adds the block-diagonal mask to the scaled products before its softmax
            "attention_scores": softmax_argument(INTERFACE_CALL),
            "layer_output": ModuleOutput(""),  # a block returns its hidden states
        }
        del found["logits"], found["final_norm_output"]
        return found

    kind_notes = {
        "*": {
            "embeddings": "the patch embeddings before ln_pre (no learned positions: they are rotary, in the "
            "attention): " + PIXTRAL_LAYOUT + "; layers[0].layer_input is ln_pre(embeddings)",
            "layer_input": PIXTRAL_LAYOUT,
            "attention_queries": "after the 2-D rotary positions (each patch's row and column in its image)",
            "attention_keys": "after the 2-D rotary positions (each patch's row and column in its image)",
            "attention_key_positions": "each patch's index in the tower's sequence (not its rotary row and column)",
            "attention_scores": "block-diagonal: the scaled products plus the model's mask, the dtype's minimum off "
            "the patch's own image",
            "attention_probabilities": "block-diagonal: each patch sees every patch of its own image and no other "
            "(the model's mask over image_sizes); zero off its image",
            "layer_output": "the projector reads hidden_states[vision_feature_layer] (the model config's; -1 in "
            "Mistral 3's and Pixtral-12B's: the last block's layer_output); the blocks after it, if any, run, but "
            "nothing reads their outputs",
        }
    }
    kind_reasons = {
        "*": {
            "logits": "a vision tower has no logits: one block's output (the model's vision_feature_layer) is what "
            "the projector reads",
            **dict.fromkeys(CACHE_VALUES, "a vision tower caches nothing: it runs once over each image"),
        }
    }


def _pixtral_processor():
    """transformers' `PixtralProcessor` class. In 5.25 its module imports one sizing function from the torchvision
    image processor's module, which imports torchvision (not installed here); the PIL image processor's module defines
    the same function, so that module stands in for the one import, then is taken out again."""
    name = "transformers.models.pixtral.image_processing_pixtral"
    try:
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor
    except ModuleNotFoundError as error:
        if error.name != "torchvision":
            raise
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        stand_in = types.ModuleType(name)
        stand_in.get_resize_output_image_size = pil.get_resize_output_image_size  # type: ignore[attr-defined]
        sys.modules[name] = stand_in
        try:
            from transformers.models.pixtral.processing_pixtral import PixtralProcessor
        finally:
            del sys.modules[name]
    return PixtralProcessor


class PixtralImages(ImageTokens):
    """The Pixtral processor's layout (Mistral 3, LLaVA with a Pixtral tower): an image is its grid of merged patches
    (`image_sizes` over `patch_size * spatial_merge_size`, no merge where the config has none), row by row: each
    row's `image_token_id` tokens, then one special token ([IMG_BREAK], [IMG_END] after the last row).

    `needs_sizes`: the model reads `image_sizes` (Mistral 3's projector does); else an image without them is the
    padded `pixel_values`' full size, as the tower then reads it."""

    def __init__(self, needs_sizes: bool = False) -> None:
        self.needs_sizes = needs_sizes

    def grid(self, config, inputs, image):
        step = config.vision_config.patch_size * getattr(config, "spatial_merge_size", 1)
        sizes = inputs.get("image_sizes")
        if sizes is None and (self.needs_sizes or inputs.get("pixel_values") is None):
            raise ValueError(
                f"image_sizes: a {config.model_type} image's grid is its size (pixels) over patch_size * "
                f"spatial_merge_size ({step}); pass the processor's image_sizes with the prompt"
            )
        if sizes is None:
            rows, cols = patch_grids(config.vision_config, inputs)[image]
            return rows * config.vision_config.patch_size // step, cols * config.vision_config.patch_size // step
        if image >= len(sizes):
            raise ValueError(
                f"input_ids: the prompt holds more images than image_sizes gives ({len(sizes)}): pass the processor's "
                f"input_ids and image_sizes together"
            )
        height, width = (int(side) for side in sizes[image])
        return height // step, width // step

    def positions(self, config, input_ids, inputs):
        found = super().positions(config, input_ids, inputs)
        kind = found.kind
        for b, grids in enumerate(found.grids):
            for image, (rows, cols) in enumerate(grids):
                where = found.of_image(image, b).view(rows, cols)
                after = where[:, -1] + 1  # the token after each row: [IMG_BREAK], [IMG_END] after the last
                apart = (where[:, 1:] - where[:, :-1] != 1).any(1)
                if apart.any() or after[-1] >= kind.shape[1] or (kind[b, after] != 0).any():
                    raise ValueError(
                        f"input_ids: image {image} of prompt {b} is not laid out as {rows} rows of {cols} "
                        f"{self.image_token} tokens, each followed by one [IMG_BREAK] or [IMG_END] token: pass the "
                        f"processor's input_ids unchanged"
                    )
                kind[b, after] = SPECIAL
        return found

    def tiny_processor(self, config, char_tokenizer):
        from transformers import PixtralImageProcessorPil

        names = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
        at = dict(zip(names.values(), range(config.image_token_id, config.image_token_id + 3)))
        tokenizer = char_tokenizer(config.image_token_id, extra=at, named=names)
        vision, merge = config.vision_config, getattr(config, "spatial_merge_size", 1)
        step = {"height": vision.patch_size * merge, "width": vision.patch_size * merge}
        images = PixtralImageProcessorPil(size={"longest_edge": vision.image_size}, patch_size=step)
        return _pixtral_processor()(
            image_processor=images, tokenizer=tokenizer, patch_size=vision.patch_size, spatial_merge_size=merge
        )
