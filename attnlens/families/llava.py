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
CLASS, NEWLINE = KINDS.index("class"), KINDS.index("newline")


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
                "model.positions: LLaVA given image_sizes splits its features per image size (a Pixtral tower's "
                "layout): serve the model with family=attnlens.families.llava_pixtral.PixtralLlava"
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
    #: What to do with a checkpoint of another tower, by its class (refused at load with this).
    other_towers = {"PixtralVisionModel": "pass family=attnlens.families.llava_pixtral.PixtralLlava"}
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


def stitched_grid(config, image_size) -> tuple[tuple[int, int], tuple[int, int]]:
    """The grid of an image's tiles stitched and unpadded, as LLaVA-NeXT's `pack_image_features` cuts it from the
    image's (height, width) `image_size`: ((rows, columns), (first row, first column) kept of the padded grid). The
    tiles are `vision_config.image_size` squares of the best-fitting `image_grid_pinpoints` resolution
    (`select_best_resolution`), each (image_size / patch_size)^2 patches; `unpad_image` then cuts rows (or columns)
    from both ends, `(padded - round(kept)) // 2` each, so that the grid keeps the image's aspect."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = (int(n) for n in image_size)
    tile, side = config.vision_config.image_size, config.vision_config.image_size // config.vision_config.patch_size
    best_height, best_width = select_best_resolution((height, width), config.image_grid_pinpoints)
    rows, cols = best_height // tile * side, best_width // tile * side
    if width / height > cols / rows:  # wider than the padded grid: rows cut
        cut = (rows - int(round(height * (cols / width), 7))) // 2
        return (rows - 2 * cut, cols), (cut, 0)
    cut = (cols - int(round(width * (rows / height), 7))) // 2
    return (rows, cols - 2 * cut), (0, cut)


class LlavaNextImages(ImageTokens):
    """LLaVA-NeXT's images ("anyres"): each is two views under `image_token_id`, in this order: its base view (the
    whole image resized to the tower's square: (image_size / patch_size)^2 patches, row-major), then its tiles
    stitched into one grid of the best-fitting `image_grid_pinpoints` resolution and unpadded to the image's aspect
    (`stitched_grid`, from `image_sizes`), row-major, each row ended by an `image_newline` feature (kind "newline",
    on the row it ends)."""

    def grid(self, config, inputs, image):
        side = config.vision_config.image_size // config.vision_config.patch_size
        return side, side

    def tiny_processor(self, config, char_tokenizer):
        from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

        image = "<image>"
        tokenizer = char_tokenizer(
            config.image_token_id, extra={image: config.image_token_id}, named={"image_token": image}
        )
        side = config.vision_config.image_size
        images = LlavaNextImageProcessorPil(
            size={"shortest_edge": side},
            crop_size={"height": side, "width": side},
            image_grid_pinpoints=config.image_grid_pinpoints,
        )
        return LlavaNextProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            patch_size=config.vision_config.patch_size,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops (one less)
        )

    def positions(self, config, input_ids, inputs):
        if config.vision_feature_select_strategy != "default":
            raise Unavailable(
                f"model.positions: LLaVA-NeXT under vision_feature_select_strategy "
                f"{config.vision_feature_select_strategy!r} keeps each crop's class token, which transformers' "
                f"pack_image_features cannot stitch into the tiles' grid (the model raises on a tiled image); "
                f"attnlens lays out the 'default' strategy only"
            )
        sizes = inputs.get("image_sizes")
        if sizes is None:
            raise ValueError(
                "image_sizes: a LLaVA-NeXT image's tiled grid follows its size; pass the processor's image_sizes"
            )
        ids = (input_ids if input_ids.dim() == 2 else input_ids[None]).cpu()
        token, side = getattr(config, self.image_token), self.grid(config, inputs, 0)[0]
        is_image = ids == token
        kind, view = is_image.long(), torch.full_like(ids, -1)
        image, row, col = (torch.full_like(ids, -1) for _ in range(3))
        views: list[tuple[tuple[tuple[int, int], ...], ...]] = []
        counted = 0
        for b in range(ids.shape[0]):
            where = is_image[b].nonzero().flatten().tolist()
            own: list[tuple[tuple[int, int], ...]] = []
            at = 0
            while at < len(where):
                if counted >= len(sizes):
                    raise ValueError(
                        f"input_ids: prompt {b} holds more images than image_sizes gives ({len(sizes)}): pass the "
                        f"processor's input_ids and image_sizes together"
                    )
                (rows, cols), _ = stitched_grid(config, sizes[counted])
                count = side * side + rows * (cols + 1)
                span = torch.tensor(where[at : at + count], dtype=torch.long)
                if len(span) < count:
                    raise ValueError(
                        f"input_ids: image {len(own)} of prompt {b} has {len(span)} image tokens "
                        f"({self.image_token} = {token}) where its base view and tiles need {side} x {side} + "
                        f"{rows} x ({cols} + 1 newline): pass the processor's input_ids unchanged"
                    )
                base, tiles = span[: side * side], span[side * side :]
                image[b, span] = len(own)
                view[b, base], view[b, tiles] = 0, 1
                row[b, base], col[b, base] = torch.arange(side * side) // side, torch.arange(side * side) % side
                row[b, tiles] = torch.arange(len(tiles)) // (cols + 1)
                col[b, tiles] = torch.arange(len(tiles)) % (cols + 1)
                newline = tiles[cols :: cols + 1]
                kind[b, newline], col[b, newline] = NEWLINE, -1
                own.append(((side, side), (rows, cols)))
                at, counted = at + count, counted + 1
            views.append(tuple(own))
        grids = tuple(tuple(image_views[0] for image_views in own) for own in views)
        return Positions(kind, image, row, col, grids, view, tuple(views))


class LlavaNext(LanguageModelOf, Llama):
    """LLaVA-NeXT ("llava_next", `LlavaNextForConditionalGeneration`): LLaVA's CLIP tower over each image's anyres
    crops (its base view and its tiles, `image_sizes`), the features packed with `image_newline` tokens, a Llama
    language model attending causally; `model.positions` places each image's two views (`LlavaNextImages`)."""

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
