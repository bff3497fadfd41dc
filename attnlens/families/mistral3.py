"""Mistral 3 ("mistral3", `Mistral3ForConditionalGeneration`: Mistral Small 3.1 and 3.2, Magistral Small): a Pixtral
vision tower, a patch merger and projector, a Mistral language model.

transformers 5.25 holds the tower at `model.vision_tower` (a `PixtralVisionModel`: every image at its own size, one
sequence of their patches, a 2-D rotary, a block-diagonal mask over images; `PixtralTower` serves it as
`model.vision`), the projector at `model.multi_modal_projector` (RMSNorm, then the patch merger: each
`spatial_merge_size` x `spatial_merge_size` block of an image's patch grid concatenated and mixed by
`merging_layer`, then two linear layers), and the language model at `model.language_model` (a `MistralModel`),
the head at `lm_head`: Mistral's family through `LanguageModelOf` serves the language model.

How a prompt holds an image (the Pixtral processor): the image is resized to fit `longest_edge`, its sides rounded
up to `patch_size * spatial_merge_size` (`image_sizes` gives each image's size in pixels); its grid is that size over
`patch_size * spatial_merge_size`, and the prompt holds it row by row: a row's `image_token_id` ([IMG]) tokens, then
[IMG_BREAK] after each row but the last, [IMG_END] after the last. The break and end tokens are the model's own
embeddings (special positions, not features). The features are the tower's hidden states at
`vision_feature_layer` (-1: the last block's output). The image tokens attend causally, as text does: the mask is
the text model's.
"""

from __future__ import annotations

from ..family import TINY_DEFAULTS, Tiny
from ..parts.multimodal import LanguageModelOf, Tower, released_vllm
from .mistral import Mistral
from .vision_pixtral import PixtralImages, PixtralTower

#: The tiny recipe's [IMG] id (past the character tokenizer's 128 ids, so no text prompt holds one); its processor's
#: [IMG_BREAK] and [IMG_END] take the two ids after it (the released tokenizer's are 10, 12, 13).
TINY_IMAGE = 129


#: The tiny recipe's Pixtral tower: 2 blocks 32 wide (2 heads of 16), patches of 4 pixels, images up to 32 x 32
#: (8 x 8 patches, 4 x 4 tokens merged 2 x 2).
TOWER = {
    "model_type": "pixtral",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 4,
    "initializer_range": 0.2,  # the language model's (TINY_DEFAULTS): the tower's blocks move what it hands on
}


class Mistral3(LanguageModelOf, Mistral):
    """Mistral 3: Pixtral's tower as `model.vision`, a Mistral language model whose image tokens attend causally;
    `model.positions` places each image token on its image's merged grid, [IMG_BREAK] and [IMG_END] special."""

    model_types = ("mistral3",)
    towers = {"vision": Tower("model.vision_tower", PixtralTower)}
    images = PixtralImages(needs_sizes=True)
    tiny = Tiny(
        "Mistral3Config",
        "Mistral3ForConditionalGeneration",
        {
            "text_config": {"model_type": "mistral", **TINY_DEFAULTS, "vocab_size": 132},
            "image_token_index": TINY_IMAGE,
            "vision_config": TOWER,
        },
    )
    vllm = released_vllm(Mistral, "mistral3", tiny)  # vLLM's mistral3 (tests_vllm/test_images_more.py)
    kind_notes = {
        "*": {
            "attention_probabilities": "image tokens attend causally, as text does: Mistral 3's mask is its text "
            "model's",
        }
    }

    #: Ministral 3's checkpoints hold a "ministral3" language model, which scales its queries by position
    built_of = {"text": ("mistral",), "vision": ("pixtral",)}
