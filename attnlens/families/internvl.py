"""InternVL ("internvl", `InternVLForConditionalGeneration`: InternVL 3's "-hf" checkpoints): an InternViT vision
tower, a pixel shuffle and projector, a Qwen2 language model.

transformers 5.25 holds the tower at `model.vision_tower` (an `InternVLVisionModel`, served as `model.vision` by
`InternViTTower`), the projector at `model.multi_modal_projector`, the language model at `model.language_model` (a
`Qwen2Model`; Qwen2's family through `LanguageModelOf` serves it), the head at `lm_head`.

The tower reads each tile (a square image of `image_size` pixels) on its own: a class embedding, then the patch
embeddings row-major, learned positions added (`embeddings`); each block is pre-norm `layernorm_before`, attention
(`q_proj`, `k_proj`, `v_proj`; where `use_qk_norm` is set, an RMSNorm over all heads' queries and one over all heads'
keys before they are split into heads; transformers' attention interface; `projection_layer`), the output scaled per
channel by the layer scale `lambda_1` before the residual add, pre-norm `layernorm_after`, the MLP (`fc1`,
`activation_fn`, `fc2`) scaled by `lambda_2` before the residual add. No mask: every position of a tile sees every
position of it. The model reads `hidden_states[vision_feature_layer]` (-1: the tower's `last_hidden_state`, after
`layernorm`, an identity where `use_mean_pooling` is set), drops the class token's row (strategy "default"), and
pixel-shuffles the tile's patch grid by `downsample_ratio` (0.5: each 2 x 2 block of patches one token), which the
projector (LayerNorm, two linear layers) maps to the language model's width.

How a prompt holds an image (the InternVL processor, `crop_to_patches`): the image is cut into tiles (a grid of crops,
then a thumbnail of the whole image where there is more than one crop), each tile one `pixel_values` row; the prompt
holds `<img>`, then `image_seq_length` `image_token_id` ([IMG_CONTEXT]) tokens per tile, tile after tile, then
`</img>`. A tile's tokens are its pixel-shuffled grid (side: `image_size / patch_size * downsample_ratio`), row-major:
`model.positions` makes each tile one view of its image (the crops in the processor's order, the thumbnail last). The
image tokens attend causally, as text does: the mask is the text model's.
"""

from __future__ import annotations

import torch

from ..errors import Miswired
from ..family import TINY_DEFAULTS, Tiny
from ..parts import identities
from ..parts.multimodal import IMAGE, ImageTokens, LanguageModelOf, Positions, Tower, released_vllm
from ..parts.sizes import Sizes
from .qwen2 import Qwen2
from .vision import SiglipTower
from .vision_pixtral import SPECIAL

#: The tiny recipe's [IMG_CONTEXT] id (past the character tokenizer's 128 ids); its processor's <img>, </img> and
#: <video> take the ids after it.
TINY_IMAGE = 129

#: The tiny recipe's InternViT tower: 2 blocks 32 wide (2 heads of 16), tiles of 16 x 16 pixels in 4 x 4 patches of
#: 4 (the class token and 16 patches), shuffled 2 x 2 into 2 x 2 tokens; the query and key norms on.
TOWER = {
    "model_type": "internvl_vision",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "image_size": 16,
    "patch_size": 4,
    "use_qk_norm": True,
    "layer_scale_init_value": 0.5,
    "initializer_range": 0.2,  # the language model's (TINY_DEFAULTS): the tower's blocks move what it hands on
}


def _side(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


class InternViTTower(SiglipTower):
    """InternVL's vision tower (`InternVLVisionModel`), as a stack of a multimodal model: each tile its own sequence
    (the class token, then its patches), layer scale on both sublayers, optional norms over all heads' queries and
    keys (the module docstring)."""

    layers = "encoder.layer"
    final_norm = "layernorm"
    attention = "attention"
    attention_norm = "layernorm_before"
    mlp_norm = "layernorm_after"
    output_projection = "projection_layer"
    sizes = Sizes(num_heads=("num_heads",), head_dim=("head_dim",), scale=("scale",))

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Each sublayer's output is scaled per channel by the block's layer scale before the residual add."""
            return stream + (block.lambda_1 if sublayer == "attention" else block.lambda_2) * update

    kind_notes = {
        "*": {
            "embeddings": "the class embedding then the patch embeddings, learned positions added: one sequence per "
            "tile (batch axis: the pixel_values rows, every image's tiles), row 0 the class token, then one row per "
            "patch, row-major over the tile's patch grid",
            "attention_queries": "after q_norm where use_qk_norm is set (an RMSNorm over all heads' queries at once, "
            "before they are split into heads)",
            "attention_keys": "after k_norm where use_qk_norm is set (an RMSNorm over all heads' keys at once, "
            "before they are split into heads)",
            "attention_probabilities": "bidirectional: every position (the class token and every patch) sees every "
            "position of its tile",
            "attention_output": "projection_layer's output, before the layer scale lambda_1: layer_mid is "
            "layer_input + lambda_1 * attention_output",
            "mlp_output": "fc2's output, before the layer scale lambda_2: layer_output is layer_mid + lambda_2 * "
            "mlp_output",
            "final_norm_output": "the tower's layernorm (an identity where use_mean_pooling is set, as in InternVL "
            "3's configs): the last_hidden_state InternVL's projector reads under vision_feature_layer -1, the class "
            "token's row dropped, pixel-shuffled",
            "layer_output": "under a vision_feature_layer other than -1 the projector reads hidden_states[layer] "
            "(layer_output of the block before it); the blocks after it run, but nothing reads their outputs",
        }
    }

    def verify(self, model, layer, layer_module, attention_module):
        """An InternViT block holds its layer scales (the identities read them)."""
        if not hasattr(layer_module, "lambda_1") or not hasattr(layer_module, "lambda_2"):
            raise Miswired(f"family {self.name}: block {layer} has no layer scales (lambda_1, lambda_2)")
        super().verify(model, layer, layer_module, attention_module)


class InternVLImages(ImageTokens):
    """The InternVL processor's layout: each image `<img>`, `image_seq_length` [IMG_CONTEXT] tokens per tile, `</img>`;
    each tile one view, its pixel-shuffled grid row-major. The config does not name the `<img>` and `</img>` ids: the
    token before and the token after each run are the special ones."""

    @staticmethod
    def tile_grid(config) -> tuple[int, int]:
        """(rows, columns) of a tile's tokens: its patch grid shrunk by the pixel shuffle's `downsample_ratio`."""
        vision = config.vision_config
        side = int(_side(vision.image_size) // _side(vision.patch_size) * config.downsample_ratio)
        return side, side

    def positions(self, config, input_ids, inputs):
        ids = (input_ids if input_ids.dim() == 2 else input_ids[None]).cpu()
        rows, cols = self.tile_grid(config)
        per_tile = rows * cols
        is_image = ids == config.image_token_id
        kind = torch.where(is_image, IMAGE, 0)
        image, view, row, col = (torch.full_like(ids, -1) for _ in range(4))
        views, tiles = [], 0
        for b in range(ids.shape[0]):
            where = is_image[b].nonzero().flatten()
            runs = where.tensor_split((where[1:] - where[:-1] != 1).nonzero().flatten() + 1) if len(where) else []
            own = []
            for i, run in enumerate(runs):
                start, end = int(run[0]), int(run[-1]) + 1
                if len(run) % per_tile or start == 0 or end == ids.shape[1]:
                    raise ValueError(
                        f"input_ids: image {i} of prompt {b} has {len(run)} image tokens ({self.image_token} = "
                        f"{config.image_token_id}) where each tile needs {per_tile} ({rows} x {cols}), between <img> "
                        f"and </img>: pass the processor's input_ids unchanged"
                    )
                at = torch.arange(len(run))
                image[b, run], view[b, run] = i, at // per_tile
                row[b, run], col[b, run] = at % per_tile // cols, at % cols
                kind[b, start - 1] = kind[b, end] = SPECIAL
                own.append(((rows, cols),) * (len(run) // per_tile))
                tiles += len(run) // per_tile
            views.append(tuple(own))
        pixels = inputs.get("pixel_values")
        if pixels is not None and pixels.shape[0] != tiles:
            raise ValueError(
                f"pixel_values: {pixels.shape[0]} tiles where input_ids hold {tiles}: pass the processor's "
                f"input_ids and pixel_values together"
            )
        first = tuple(tuple(grids[0] for grids in own) for own in views)
        return Positions(kind, image, row, col, first, view, tuple(views))

    def tiny_processor(self, config, char_tokenizer):
        """InternVL's processor on the PIL image processor (GOT-OCR 2's tiling) at the tower's tile size, up to 4
        crops; no video processor (transformers' needs torchvision, which attnlens does not install)."""
        from transformers import GotOcr2ImageProcessorPil, InternVLProcessor

        class ImagesOnly(InternVLProcessor):
            def check_argument_for_proper_class(self, argument_name, argument):
                if argument_name == "video_processor" and argument is None:
                    return None  # (looking the class up imports torchvision)
                return super().check_argument_for_proper_class(argument_name, argument)

        names = {
            "context_image_token": "<IMG_CONTEXT>",
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "video_token": "<video>",
        }
        at = dict(zip(names.values(), range(config.image_token_id, config.image_token_id + len(names))))
        tokenizer = char_tokenizer(config.image_token_id, extra=at, named=names)
        side = _side(config.vision_config.image_size)
        images = GotOcr2ImageProcessorPil(size={"height": side, "width": side}, max_patches=4, crop_to_patches=True)
        rows, cols = self.tile_grid(config)
        return ImagesOnly(
            image_processor=images, tokenizer=tokenizer, video_processor=None, image_seq_length=rows * cols
        )


class InternVL(LanguageModelOf, Qwen2):
    """InternVL: InternViT's tower as `model.vision`, a Qwen2 language model whose image tokens attend causally;
    `model.positions` places each image token on its tile's grid, each tile a view."""

    model_types = ("internvl",)
    towers = {"vision": Tower("model.vision_tower", InternViTTower)}
    images = InternVLImages()
    tiny = Tiny(
        "InternVLConfig",
        "InternVLForConditionalGeneration",
        {
            "text_config": {"model_type": "qwen2", **TINY_DEFAULTS, "vocab_size": 133},
            "image_token_id": TINY_IMAGE,
            "image_seq_length": 4,
            "vision_config": TOWER,
        },
    )
    #: vLLM's InternVLForConditionalGeneration (interns1.py): Qwen2's text class as `language_model`
    #: (tests_vllm/test_images_more.py)
    vllm = released_vllm(Qwen2, "internvl", tiny)
    kind_notes = {
        "*": {
            "attention_probabilities": "image tokens attend causally, as text does: InternVL's mask is its text "
            "model's",
        }
    }

    built_of = {"text": ("qwen2",)}  # InternVL 3 (3.5's Qwen3 and GPT-OSS: other arithmetic)
