"""LLaVA's variants: VipLLaVA (features from several tower layers) and LLaVA-OneVision (LLaVA-NeXT's anyres over a
SigLIP tower, a Qwen2 language model).

VipLLaVA ("vipllava", `VipLlavaForConditionalGeneration`): LLaVA's CLIP tower at `model.vision_tower`, a projector
(`projector_layernorm`, `linear_1`, `act`, `linear_2`) over the tower's hidden states at each of
`vision_feature_layers` (-2, -5, -8, -11 and 6 in the released checkpoints: hidden_states[k] is block k-1's output,
0 the first block's input after pre_layrnorm), each with the class token's row dropped, concatenated along the width;
a Llama language model. An image is its (image_size / patch_size)^2 patches, row-major, under `image_token_id`, with
nothing around them; its tokens attend causally.

LLaVA-OneVision ("llava_onevision", `LlavaOnevisionForConditionalGeneration`): a SigLIP tower over each image's
anyres crops (its base view and the tiles of the best-fitting `image_grid_pinpoints`), the features of
`vision_feature_layer` ("full": every patch, SigLIP has no class token) projected, then packed as LLaVA-NeXT packs
them: the base view's grid, then the tiles stitched into one grid, unpadded to the image's aspect (`image_sizes`),
shrunk by bilinear interpolation where it holds more than `vision_aspect_ratio`'s ("anyres_max_9") nine base views
of patches, each row ended by an `image_newline` feature (an image among several of a prompt is its base view and
one newline); a Qwen2 language model attending causally.
"""

from __future__ import annotations

from ..errors import Unavailable
from ..family import TINY_DEFAULTS, Tiny
from ..parts.multimodal import ImageTokens, LanguageModelOf, Tower, released_vllm
from ..parts.vllm import VLLMLayout
from .llama import Llama
from .llava import TOWER as CLIP_TOWER
from .llava import LlavaImages
from .qwen2 import Qwen2
from .vision import TINY_TOWER, ClipTower, SiglipTower


class VipLlavaImages(LlavaImages):
    """An image is a run of `image_token_id` tokens: its patch grid, row-major, the class token's row always
    dropped (VipLLaVA has no feature strategy)."""

    @staticmethod
    def leading(config) -> int:
        return 0


class VipLlavaTower(ClipTower):
    """CLIP's tower as VipLLaVA reads it: several blocks' outputs at once."""

    kind_notes = {
        "*": {
            "layer_output": "VipLLaVA's projector reads hidden_states at each of vision_feature_layers (the config's; "
            "-2, -5, -8, -11 and 6 released: hidden_states[k] is block k-1's layer_output, 0 is layers[0]."
            "layer_input), the class token's row dropped, concatenated along the width; blocks after the last one "
            "read run, but nothing reads their outputs",
        }
    }
    kind_reasons = {
        "*": {
            "logits": "a vision tower has no logits: several blocks' outputs (VipLLaVA's vision_feature_layers) are "
            "what the projector reads",
        }
    }


class VipLlava(LanguageModelOf, Llama):
    """VipLLaVA: LLaVA's CLIP tower as `model.vision`, read at several layers; `model.positions` places each image
    token on its image's patch grid."""

    model_types = ("vipllava",)
    towers = {"vision": Tower("model.vision_tower", VipLlavaTower)}
    images = VipLlavaImages()
    vllm = VLLMLayout(refusal="attnlens has not compared VipLLaVA's language model on vLLM with transformers")
    tiny = Tiny(
        "VipLlavaConfig",
        "VipLlavaForConditionalGeneration",
        {
            "text_config": {"model_type": "llama", **TINY_DEFAULTS, "vocab_size": 132},
            "image_token_index": 129,
            "image_seq_length": 16,  # the 4 x 4 patches
            "vision_config": CLIP_TOWER,
            "vision_feature_layers": [0, -1],  # the first block's input (after pre_layrnorm) and the last's output
        },
    )
    kind_notes = {
        "*": {
            "attention_probabilities": "image tokens attend causally, as text does: VipLLaVA's mask is its text "
            "model's",
        }
    }


class OnevisionImages(ImageTokens):
    """LLaVA-OneVision's images: anyres, as LLaVA-NeXT's, with a shrink; `positions` refused (the reason)."""

    refused = (
        "model.positions: a LLaVA-OneVision image is two grids (its base view's (image_size / patch_size)^2 patches, "
        "then its anyres tiles stitched, unpadded to the image's aspect and shrunk by bilinear interpolation past "
        "vision_aspect_ratio's count, each row ended by an image_newline token), which attnlens's Positions (one grid "
        "per image) does not hold; its values on image tokens are served"
    )

    def positions(self, config, input_ids, inputs):
        raise Unavailable(self.refused)


class LlavaOnevision(LanguageModelOf, Qwen2):
    """LLaVA-OneVision: SigLIP's tower as `model.vision` over each image's anyres crops, a Qwen2 language model whose
    image tokens attend causally; `model.positions` is refused (two grids per image, shrunk, newline tokens).
    Videos (`pixel_values_videos`) run the tower again, over their frames: attnlens has compared prompts with images
    only."""

    model_types = ("llava_onevision",)
    towers = {"vision": Tower("model.vision_tower", SiglipTower)}
    images = OnevisionImages()
    tiny = Tiny(
        "LlavaOnevisionConfig",
        "LlavaOnevisionForConditionalGeneration",
        {
            "text_config": {"model_type": "qwen2", **TINY_DEFAULTS, "vocab_size": 132},
            "image_token_index": 129,
            "video_token_index": 130,
            "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64]],  # tiles of the tower's 32 x 32
            "vision_config": {"model_type": "siglip_vision_model", **TINY_TOWER},
        },
    )
    vllm = released_vllm(Qwen2, "llava_onevision", tiny)  # vLLM's llava_onevision (tests_vllm/test_images_more.py)
    kind_notes = {
        "*": {
            "attention_probabilities": "image tokens attend causally, as text does: LLaVA-OneVision's mask is its "
            "text model's",
        }
    }

    built_of = {"text": ("qwen2",), "vision": ("siglip_vision_model",)}  # as released
