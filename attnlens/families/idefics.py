"""Idefics3 ("idefics3", `Idefics3ForConditionalGeneration`) and SmolVLM ("smolvlm", `SmolVLMForConditionalGeneration`):
a SigLIP-like vision transformer, a pixel-shuffle connector, a Llama language model.

transformers 5.25 holds the tower at `model.vision_model` (`embeddings`, `encoder.layers`, `post_layernorm`: SigLIP's
block, served by `SiglipTower` as `model.vision`), the connector at `model.connector` (pixel shuffle, then
`modality_projection`), the language model at `model.text_model` (a `LlamaModel`), the head at `lm_head`: Llama's
family through `LanguageModelOf` serves the language model.

How a prompt holds an image (the Idefics3 processor, which SmolVLM's copies): the image is resized and, with
`do_image_splitting`, cut into a grid of `max_image_size` tiles, then resized whole to one more tile, its global view.
The prompt holds, per tile row by row, `<fake_token_around_image><row_i_col_j>` and the tile's `image_seq_len` image
tokens, a newline after each row of tiles, then a newline, `<fake_token_around_image><global-img>`, the global view's
image tokens and `<fake_token_around_image>` (an unsplit image: the global view alone). Each view's tokens are the
tower's last hidden states (after `post_layernorm`) pixel-shuffled: every `scale_factor` x `scale_factor` block of
the view's patch grid becomes one token, row-major over the (side / scale_factor)^2 grid of blocks. The image tokens
attend causally, as text does: the mask is the text model's.

Idefics2 ("idefics2") has the same tower (a patch real only where all its pixels are), a Mistral language model, and
a perceiver resampler for a connector: each view becomes `resampler_n_latents` learned latents that read all of its
patches, so its image tokens have no place on a grid (`model.positions` refused) and the resampler's own attention
is not mounted (`towers_refused`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import Unavailable
from ..family import TINY_DEFAULTS, Tiny
from ..parts.multimodal import KINDS, ImageTokens, LanguageModelOf, Positions, Tower, released_vllm
from ..parts.vllm import VLLMLayout
from .llama import Llama
from .mistral import Mistral
from .vision import PaddedPatches, SiglipTower

IMAGE, SPECIAL = KINDS.index("image"), KINDS.index("special")
#: The tiny recipe's added tokens, ids from 128 (after the character tokenizer's) in this order: the image token
#: first (its config's `image_token_id`), the special tokens around an image, a newline (which the character tokenizer
#: lacks), and the 6 x 6 tile tags the processor names.
TINY_TOKENS = (
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    "\n",
    *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)),
)


def real_patches(config, inputs: dict, whole: bool = False) -> torch.Tensor:
    """[views, patches]: whether each patch of each view the tower runs on is real, as the model derives its
    `patch_attention_mask`: the views (`pixel_values` [batch, views, ...]) that are not all zero (the padding views
    of a batch's shorter rows, which it drops), each patch real where `pixel_attention_mask` has a pixel in it
    (Idefics3), or where every pixel of it is (`whole`: Idefics2); every patch where no mask is given."""
    pixels = torch.as_tensor(inputs["pixel_values"]).cpu()
    pixels = pixels.reshape(-1, *pixels.shape[2:])
    kept = (pixels == 0.0).sum(dim=(-1, -2, -3)) != pixels.shape[1:].numel()
    given = inputs.get("pixel_attention_mask")
    if given is None:
        return torch.ones(
            int(kept.sum()),
            (pixels.shape[-2] // config.patch_size) * (pixels.shape[-1] // config.patch_size),
            dtype=torch.bool,
        )
    mask = torch.as_tensor(given).cpu().reshape(-1, *pixels.shape[-2:])[kept]
    side = config.patch_size
    patches = mask.unfold(1, side, side).unfold(2, side, side)
    covered = patches.sum(dim=(-1, -2))
    return (covered == side * side if whole else covered > 0).reshape(len(mask), -1)


class IdeficsTower(SiglipTower):
    """Idefics3's vision transformer: SigLIP's block over each view (a tile, a global view: one image of the tower's
    batch); the model masks the keys of the patches that cover only padding (`pixel_attention_mask`: a view smaller
    than the batch's largest), which `segments` gives the score function."""

    #: Whether a patch is real only where all its pixels are (Idefics2's rule), or where any is (Idefics3's).
    whole_patches: ClassVar[bool] = False

    ScoreFunction = PaddedPatches
    padding_from = "pixel_attention_mask"

    def segments(self, config, inputs: dict, layer: int) -> torch.Tensor:
        """[views, patches]: 0 on each view's real patches, -1 on its padding (`real_patches`); the score function's
        `image_of`. (`config`: the vision config.)"""
        return torch.where(real_patches(config, inputs, self.whole_patches), 0, -1)

    kind_notes = {
        "*": {
            **SiglipTower.kind_notes["*"],
            "attention_scores": "the dtype's minimum added at the keys of patches covering only padding "
            "(pixel_attention_mask)",
            "attention_probabilities": "bidirectional: every patch sees every real patch of its view (a tile, or the "
            "global view), none covering only padding (pixel_attention_mask; the processor's tiles are full)",
            "final_norm_output": "post_layernorm: what the connector pixel-shuffles into the image tokens",
        }
    }


class IdeficsImages(ImageTokens):
    """Each image is one view per tile (row by row), then its global view; each view a (side / scale_factor)^2 grid
    of image tokens (`image_token_id`), row-major. The tokens before each view (`<fake_token_around_image>`,
    `<row_i_col_j>` or `<global-img>`) are kind "special"; the newlines between tile rows are text.

    The config names no tag's id, so the layout is read from the prompt as the processor writes it: the token before
    the prompt's last view is the global tag (every image ends with its global view); a view it precedes ends its
    image, the views before it are the image's tiles; a tile follows the one before it on its row when only its two
    tags lie between them (a newline starts a new row)."""

    def grid(self, config, inputs, image):
        side = config.vision_config.image_size // config.vision_config.patch_size // config.scale_factor
        return side, side

    def tiny_processor(self, config, char_tokenizer):
        from transformers import Idefics3ImageProcessorPil, Idefics3Processor

        tokens = {token: 128 + k for k, token in enumerate(TINY_TOKENS)}
        named = {
            "image_token": "<image>",
            "fake_image_token": "<fake_token_around_image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
        }
        side = config.vision_config.image_size
        images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * side}, max_image_size={"longest_edge": side})
        rows, cols = self.grid(config, {}, 0)
        # SmolVLM's processor (the same layout) needs num2words, not installed here: Idefics3's is used for both
        return Idefics3Processor(images, char_tokenizer(128, extra=tokens, named=named), image_seq_len=rows * cols)

    def positions(self, config, input_ids, inputs):
        ids = (input_ids if input_ids.dim() == 2 else input_ids[None]).cpu()
        token, (rows, cols) = config.image_token_id, self.grid(config, inputs, 0)
        count = rows * cols
        kind = torch.where(ids == token, IMAGE, 0)
        image, view, row, col = (torch.full_like(ids, -1) for _ in range(4))
        views = []
        for b in range(ids.shape[0]):
            where = (ids[b] == token).nonzero().flatten()
            if len(where) % count or (len(where) and bool((where.view(-1, count).diff() != 1).any())):
                raise ValueError(
                    f"input_ids: prompt {b} holds {len(where)} image tokens ({token}), not runs of {rows} x {cols} "
                    f"(image_seq_len): pass the processor's input_ids unchanged"
                )
            starts = where[::count].tolist()
            own: list[tuple[tuple[int, int], ...]] = []
            tiles: list[int] = []
            global_tag = int(ids[b, starts[-1] - 1]) if starts else None
            for start in starts:
                run = torch.arange(start, start + count)
                kind[b, start - 2 : start] = SPECIAL  # <fake_token_around_image>, then the tile's or global tag
                row[b, run], col[b, run] = torch.arange(count) // cols, torch.arange(count) % cols
                if int(ids[b, start - 1]) != global_tag:
                    tiles.append(start)
                    continue
                kind[b, start + count] = SPECIAL  # the closing <fake_token_around_image>
                on_row = [0 if k == 0 or start_ - tiles[k - 1] != count + 2 else 1 for k, start_ in enumerate(tiles)]
                across = on_row.index(0, 1) if 0 in on_row[1:] else len(tiles)
                if tiles and len(tiles) % across:
                    raise ValueError(
                        f"input_ids: image {len(own)} of prompt {b} has {len(tiles)} tiles in rows of {across}: pass "
                        f"the processor's input_ids unchanged"
                    )
                for v, first in enumerate([*tiles, start]):
                    span = torch.arange(first, first + count)
                    image[b, span], view[b, span] = len(own), v
                own.append(((rows, cols),) * (len(tiles) + 1))
                tiles = []
            if tiles:
                raise ValueError(
                    f"input_ids: prompt {b} ends with {len(tiles)} tiles and no global view: pass the processor's "
                    f"input_ids unchanged"
                )
            views.append(tuple(own))
        grids = tuple(tuple(image_views[0] for image_views in own) for own in views)
        return Positions(kind, image, row, col, grids, view, tuple(views))


def tiny(config: str, model: str) -> Tiny:
    """The tiny recipe: a Llama language model, a SigLIP-like tower of 4 x 4 patches (64 pixels, patches of 16), the
    connector's 2 x 2 shuffle making each view 2 x 2 image tokens."""
    return Tiny(
        config,
        model,
        {
            "text_config": {"model_type": "llama", **TINY_DEFAULTS, "vocab_size": 128 + len(TINY_TOKENS)},
            "image_token_id": 128,
            "scale_factor": 2,
            "vision_config": {
                "num_hidden_layers": 2,
                "hidden_size": 32,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "image_size": 64,
                "patch_size": 16,
                "initializer_range": 0.2,  # the language model's: the tower's blocks move what it hands on
            },
        },
    )


class Idefics3(LanguageModelOf, Llama):
    """Idefics3: the SigLIP-like tower as `model.vision` (each tile and global view an image of its batch), a Llama
    language model whose image tokens attend causally; `model.positions` places each tile and the global view as
    views of its image (`IdeficsImages`)."""

    model_types = ("idefics3",)
    layers = "model.text_model.layers"
    embed_tokens = "model.text_model.embed_tokens"
    final_norm = "model.text_model.norm"
    towers = {"vision": Tower("model.vision_model", IdeficsTower)}
    images = IdeficsImages()
    tiny = tiny("Idefics3Config", "Idefics3ForConditionalGeneration")
    #: vLLM's idefics3: its Idefics3Model holds the text model (vLLM's LlamaModel) as `model.text_model`, as
    #: transformers' does (tests_vllm/test_images_more.py)
    vllm = released_vllm(
        Llama, "idefics3", tiny, names={"layers": layers, "embed_tokens": embed_tokens, "final_norm": final_norm}
    )
    kind_notes = {
        "*": {
            "attention_probabilities": "image tokens attend causally, as text does: the mask is the text model's",
        }
    }

    built_of = {"text": ("llama",)}  # another text model is another family's arithmetic


class SmolVLM(Idefics3):
    """SmolVLM: Idefics3's model and prompt layout (its processor writes the same tags), a Llama language model."""

    model_types = ("smolvlm",)
    vllm = VLLMLayout(
        refusal="attnlens has not compared SmolVLM on vLLM with transformers: vLLM's SmolVLMForConditionalGeneration "
        "builds transformers' SmolVLMProcessor, which requires the num2words package (not installed; measured)"
    )
    tiny = tiny("SmolVLMConfig", "SmolVLMForConditionalGeneration")


class Idefics2Tower(IdeficsTower):
    """Idefics2's vision transformer: Idefics3's, but a patch is real only where every pixel of it is (its
    `patch_attention_mask` rule); the processor pads each view to the batch's largest, so its views have padding."""

    whole_patches = True


#: Why Idefics2's image tokens have no place on a grid.
LATENTS = (
    "each of Idefics2's image tokens is one of the perceiver resampler's resampler_n_latents learned latents, which "
    "reads every patch of its view by cross-attention: no token has a place on the view's grid"
)


class Idefics2Latents(ImageTokens):
    """Each image is one view per crop (with `do_image_splitting`: four crops, then the whole image), each
    `<fake_token_around_image>` then the resampler's `resampler_n_latents` image tokens, a closing
    `<fake_token_around_image>` after the last; `model.positions` is refused (`LATENTS`)."""

    refused = LATENTS

    def tiny_processor(self, config, char_tokenizer):
        from transformers import Idefics2ImageProcessorPil, Idefics2Processor

        # the processor adds <fake_token_around_image>, <image> (the config's image_token_id) and <end_of_utterance>
        # to the character tokenizer, in that order: ids 128, 129, 130
        side = config.vision_config.image_size
        images = Idefics2ImageProcessorPil(
            size={"longest_edge": side, "shortest_edge": side // 2}, do_image_splitting=True
        )
        latents = config.perceiver_config.resampler_n_latents
        return Idefics2Processor(images, char_tokenizer(128), image_seq_len=latents)

    def positions(self, config, input_ids, inputs):
        raise Unavailable(f"model.positions: {LATENTS}")


class Idefics2(LanguageModelOf, Mistral):
    """Idefics2: the SigLIP-like tower as `model.vision` (each crop a view, padding patches masked as keys), the
    perceiver resampler not mounted (`towers_refused`), a Mistral language model whose image tokens attend causally;
    `model.positions` refused (`LATENTS`)."""

    model_types = ("idefics2",)
    layers = Idefics3.layers
    embed_tokens = Idefics3.embed_tokens
    final_norm = Idefics3.final_norm
    towers = {"vision": Tower("model.vision_model", Idefics2Tower)}
    towers_refused = {
        "resampler": "the perceiver resampler (model.connector.perceiver_resampler: latents attending to a view's "
        "patches and to themselves, its own stack of blocks) is not mounted: its attention is not served"
    }
    images = Idefics2Latents()
    vllm = VLLMLayout(refusal="attnlens has not compared Idefics2's language model on vLLM with transformers")
    tiny = Tiny(
        "Idefics2Config",
        "Idefics2ForConditionalGeneration",
        {
            # Mistral's tiny window (4), which the image prompt's rows cross
            "text_config": {"model_type": "mistral", **TINY_DEFAULTS, **Mistral.tiny.kwargs, "vocab_size": 131},
            "image_token_id": 129,
            "vision_config": Idefics3.tiny.kwargs["vision_config"],
            "perceiver_config": {
                "hidden_size": TINY_DEFAULTS["hidden_size"],  # the text model's (its config warns otherwise)
                "rms_norm_eps": 1e-6,  # Mistral's
                "resampler_n_latents": 4,
                "resampler_depth": 1,
                "resampler_n_heads": 2,
                "resampler_head_dim": 16,
                "num_key_value_heads": 1,
            },
        },
    )
    kind_notes = Idefics3.kind_notes

    built_of = {"text": ("mistral",)}
