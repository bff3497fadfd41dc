"""LLaVA ("llava", `LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector, a Llama language
model.

transformers 5.25 holds the tower at `model.vision_tower` (a `CLIPVisionModel`: `embeddings`, `pre_layrnorm`,
`encoder.layers`, `post_layernorm`), the projector at `model.multi_modal_projector`, and the language model at
`model.language_model` (a `LlamaModel`: `embed_tokens`, `layers`, `norm`), the head at `lm_head`: Llama's family
through `LanguageModelOf` serves the language model, `ClipTower` the tower as `model.vision`.

How a prompt holds an image: the processor expands its image token into `config.image_token_id` tokens, one per
feature the projector makes, with nothing around them. The features are the tower's hidden states at
`config.vision_feature_layer` (hidden_states[k]: the block input after pre_layrnorm at 0, block k-1's output at k;
-2 by default, so the last block runs but nothing reads it): under `vision_feature_select_strategy` "default" the
class token's row is dropped and an image is its (image_size / patch_size)^2 patches, row-major; under "full" the
class token's feature comes first, a position of kind "class" (the image's summary, on no grid), then the patches.
The image tokens attend causally, as text does: LLaVA's mask is its text model's. vLLM's llava class (the tower, the
projector, Llama's class under `language_model`) gives the same values with an image (tests_vllm/test_images.py), and
so does its llava_next class with LLaVA-NeXT's anyres images (tests_vllm/test_images_more.py).
"""

from __future__ import annotations

import torch

from ..errors import Unavailable
from ..family import TINY_DEFAULTS, Tiny
from ..parts.multimodal import KINDS, ImageTokens, LanguageModelOf, Positions, Tower, released_vllm
from .llama import Llama
from .vision import TINY_TOWER, ClipTower

#: `Positions.kind` of a tower's class token.
CLASS = KINDS.index("class")


class LlavaImages(ImageTokens):
    """An image is a run of `image_token_id` tokens: its patch grid (the tower's input over `patch_size`), row-major,
    after the class token's feature where `vision_feature_select_strategy` is "full"."""

    def grid(self, config, inputs, image):
        vision = config.vision_config
        pixels = inputs.get("pixel_values")
        height, width = pixels.shape[-2:] if pixels is not None else (vision.image_size, vision.image_size)
        return height // vision.patch_size, width // vision.patch_size

    @staticmethod
    def leading(config) -> int:
        """Tokens before an image's grid: the class token's, under the "full" feature strategy."""
        return int(config.vision_feature_select_strategy == "full")

    def positions(self, config, input_ids, inputs):
        if inputs.get("image_sizes") is not None:
            raise Unavailable(
                "model.positions: LLaVA given image_sizes splits its features per image size (a Pixtral-style "
                "tower), a layout attnlens has not placed on grids; its values on image tokens are served"
            )
        ids = (input_ids if input_ids.dim() == 2 else input_ids[None]).cpu()
        token, leading = getattr(config, self.image_token), self.leading(config)
        is_image = ids == token
        kind = is_image.long()
        image, row, col = (torch.full_like(ids, -1) for _ in range(3))
        grids, counted = [], 0
        for b in range(ids.shape[0]):
            where = is_image[b].nonzero().flatten().tolist()
            own, at = [], 0
            while at < len(where):
                rows, cols = self.grid(config, inputs, counted)
                span = where[at : at + leading + rows * cols]
                if len(span) < leading + rows * cols:
                    needs = f"{'its class token and ' if leading else ''}its grid need{'' if leading else 's'}"
                    raise ValueError(
                        f"input_ids: image {len(own)} of prompt {b} has {len(span)} image tokens "
                        f"({self.image_token} = {token}) where {needs} {'1 + ' * leading}{rows} x {cols}: pass the "
                        f"processor's input_ids unchanged"
                    )
                image[b, span] = len(own)
                kind[b, span[:leading]] = CLASS
                patches = torch.tensor(span[leading:], dtype=torch.long)
                row[b, patches] = torch.arange(rows * cols) // cols
                col[b, patches] = torch.arange(rows * cols) % cols
                own.append((rows, cols))
                at, counted = at + leading + rows * cols, counted + 1
            grids.append(tuple(own))
        return Positions(kind, image, row, col, tuple(grids))


#: The tiny LLaVA and LLaVA-NeXT recipes' CLIP tower: 4 x 4 patches of 8 pixels.
TOWER = {"model_type": "clip_vision_model", **TINY_TOWER}


class Llava(LanguageModelOf, Llama):
    model_types = ("llava",)
    towers = {"vision": Tower("model.vision_tower", ClipTower)}
    images = LlavaImages()
    tiny = Tiny(
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        {
            # the image token past the character tokenizer's 128 ids, so no text prompt holds one
            "text_config": {"model_type": "llama", **TINY_DEFAULTS, "vocab_size": 132},
            "image_token_index": 129,
            "image_seq_length": 16,  # the 4 x 4 patches, the class token dropped
            "vision_config": TOWER,
        },
        layouts={"full": {"vision_feature_select_strategy": "full", "image_seq_length": 17}},
    )
    vllm = released_vllm(Llama, "llava", tiny)  # vLLM's llava (tests_vllm/test_images.py)
    kind_notes = {
        "*": {
            "attention_probabilities": "image tokens attend causally, as text does: LLaVA's mask is its text model's",
        }
    }


class LlavaNextImages(ImageTokens):
    """LLaVA-NeXT's images ("anyres"): each is its base view's (image_size / patch_size)^2 patches, then its tiles
    stitched into one grid of the best-fitting `image_grid_pinpoints` resolution, unpadded to the image's aspect
    (`image_sizes`: rows or columns cut from both ends), each row of it ended by an `image_newline` feature: two
    grids of one image at two resolutions, and newline positions, all under `image_token_id`. `Positions` places an
    image's tokens on one grid, so `positions` is refused rather than answered with one grid of the two."""

    refused = (
        "model.positions: a LLaVA-NeXT image is two grids (its base view's (image_size / patch_size)^2 patches, "
        "then its tiles stitched and unpadded to the image's aspect, each row ended by an image_newline token), "
        "which attnlens's Positions (one grid per image) does not hold; its values on image tokens are served"
    )

    def positions(self, config, input_ids, inputs):
        raise Unavailable(self.refused)


class LlavaNext(LanguageModelOf, Llama):
    """LLaVA-NeXT ("llava_next", `LlavaNextForConditionalGeneration`): LLaVA's CLIP tower over each image's anyres
    crops (its base view and its tiles, `image_sizes`), the features packed with `image_newline` tokens, a Llama
    language model attending causally; `model.positions` is refused (two grids per image, newline tokens)."""

    model_types = ("llava_next",)
    towers = {"vision": Tower("model.vision_tower", ClipTower)}
    images = LlavaNextImages()
    tiny = Tiny(
        "LlavaNextConfig",
        "LlavaNextForConditionalGeneration",
        {
            "text_config": {"model_type": "llama", **TINY_DEFAULTS, "vocab_size": 132},
            "image_token_index": 129,
            "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64]],  # tiles of the tower's 32 x 32
            "vision_config": TOWER,
        },
    )
    vllm = released_vllm(Llama, "llava_next", tiny)  # vLLM's llava_next (tests_vllm/test_images_more.py)
    kind_notes = Llava.kind_notes
