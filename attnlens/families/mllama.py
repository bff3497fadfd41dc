"""Mllama (Llama 3.2 Vision): Llama's self-attention blocks, with cross-attention blocks between them that attend from
the text to the vision tower's output.

The layers listed in `config.cross_attention_layers` are cross-attention blocks (`MllamaCrossAttentionDecoderLayer`):
`input_layernorm`, then `cross_attn` (queries from the text, QK-normed; keys and values from the projected vision
states, `cross_attention_states`, k-normed; no rotary), whose output joins the stream through a tanh gate
(`cross_attn_attn_gate`), then `post_attention_layernorm`, the MLP, whose output is zeroed on rows that see no image
(`full_text_row_masked_out_mask`) and joins through a second tanh gate (`cross_attn_mlp_gate`). `MllamaTextModel`
skips these blocks entirely when no vision states are given or cached (text alone).

Two families:

- `Mllama`, the text model (`mllama_text_model`, `MllamaForCausalLM`, what `AutoModelForCausalLM` builds from an
  mllama checkpoint): it never has vision states, so its cross-attention blocks never run; on them every value is
  unavailable and the residual stream passes them by (`layers[i + 1].layer_input` is `layers[i - 1].layer_output`).
  There `self_attn` is the cross-attention module renamed, so `layers[i].self_attn` exists on every block.
- `MllamaMultimodal`, the composite model (`mllama`, `MllamaForConditionalGeneration`) with images: the
  cross-attention blocks run, and serve the cross-attention value set (`cross_attn.attention_probabilities`, ... and
  `cross_attention_input`, `cross_attention_norm_output`) under the encoder-decoders' vocabulary; their self-attention
  values are unavailable with the reason, and the self-attention blocks' cross values likewise (`layer_kind` "cross").

The keys of `cross_attn` (its `source` axis) are the vision tower's output for the prompt row's images, flattened as
`MllamaModel` flattens them: image-major, then tile, then patch, where each tile's patches are its class token (patch
0) followed by its patch grid row-major (`(image_size // patch_size) ** 2` patches). `model.positions(...)` returns
`MllamaPositions`, whose `keys` (`CrossKeys`) names the image, tile, tile row and column, patch row and column of
every key.

The vision tower (`model.vision_model`) is served as two towers, `model.vision` (the local stack) and
`model.vision_global` (the gated stack), which run in that order before the language model's blocks
(`families.vision_mllama`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..family import TINY_DEFAULTS, Tiny, VLLMLayout, after_attention
from ..locations import INTERFACE_CALL, ModuleInput, ModuleOutput, Operation
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts import identities
from ..parts.multimodal import ImageTokens, LanguageModelOf, Positions, Tower
from ..parts.vllm import backend_refuses
from ..values import ALL_VALUES, BY_NAME, WITH_CROSS_ATTENTION
from .llama import Llama
from .vision_mllama import MllamaGlobalTower, MllamaVisionTower

CROSS = (
    "layer {layer} of Mllama is a cross-attention block (config.cross_attention_layers): it attends from the text "
    "to the vision tower's states and runs only when cross_attention_states are given or cached; on text alone the "
    "model skips it, and attnlens serves the self-attention blocks only"
)


class MllamaBlocks(Llama):
    """Llama's blocks, with the cross-attention blocks of `config.cross_attention_layers` set apart (`layer_kind`
    "cross")."""

    @staticmethod
    def cross_attention_block(config, layer: int) -> bool:
        return layer in (config.get_text_config(decoder=True).cross_attention_layers or [])

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"cross"} if self.cross_attention_block(config, layer) else kind


class Mllama(MllamaBlocks):
    model_types = ("mllama_text_model",)
    tiny = Tiny("MllamaTextConfig", "MllamaForCausalLM", {"cross_attention_layers": [1]})
    vllm = VLLMLayout(
        refusal=backend_refuses(
            "Mllama",
            "Unrecognized configuration class <class 'transformers.models.mllama.configuration_mllama."
            "MllamaTextConfig'> for this kind of AutoModel: AutoModel.",
            dropped=("MllamaForConditionalGeneration", "0.10.2"),
            why="the text model's checkpoint, mllama_text_model; a whole mllama checkpoint it runs only as a "
            "multimodal model (TransformersMultiModalForCausalLM), which builds Mllama's processor (\"Can't load image "
            'processor" from the tiny checkpoint; with a MllamaImageProcessor saved beside it its greedy tokens '
            "equal transformers'), whose locations inside vLLM's wrapper attnlens has not checked",
        )
    )

    def renames(self, engine="transformers"):
        return {**super().renames(engine), "cross_attn": "self_attn"}  # so layers[i].self_attn exists on every block

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "cross" in kind:  # only the model's own values (layer None reads as layer 0) stay
            locations = {
                name: location
                for name, location in locations.items()
                if name in ("embeddings", "final_norm_output", "logits")
            }
        return locations

    kind_reasons = {"cross": {value.name: CROSS for value in ALL_VALUES if value.scope != "model"}}


# --- the composite model, with images ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CrossKeys:
    """What each key of a cross-attention block is (the `source` axis of `cross_attn.attention_keys` and of the
    cross pattern), per prompt row: [batch, source] tensors. The keys are the row's images' tiles' patches, image-major,
    then tile, then patch; each tile holds its class token (patch 0: `patch_row` and `patch_col` -1) and then its
    `patches` x `patches` grid row-major. `tile_row` and `tile_col` place the tile in its image's grid of tiles
    (`tiles[b][i]`: rows, columns, from the processor's aspect ratio); a padding tile (an image that fills fewer than
    `max_num_tiles` tiles, or a padding image of a row with fewer images) has `real` False and tile row and column -1.
    """

    image: torch.Tensor
    tile: torch.Tensor
    tile_row: torch.Tensor
    tile_col: torch.Tensor
    patch_row: torch.Tensor
    patch_col: torch.Tensor
    real: torch.Tensor
    #: Side of a tile's patch grid (`image_size // patch_size`).
    patches: int
    #: (rows, columns) of each image's tiles, per row: `tiles[b][i]` (images of the row that are padding left out).
    tiles: tuple[tuple[tuple[int, int], ...], ...]

    def on_tiles(self, values: torch.Tensor, image: int) -> torch.Tensor:
        """`values` over the keys (the last axis: a row of a cross pattern) on `image`'s patches, its class tokens
        dropped: [..., tiles, patches, patches] over all `max_num_tiles` tiles (padding tiles included, as keys)."""
        where = (self.image[0] == image) & (self.patch_row[0] >= 0)
        tiles = int((self.image[0] == image).sum()) // (self.patches**2 + 1)
        return values[..., where].reshape(*values.shape[:-1], tiles, self.patches, self.patches)

    def on_image(self, values: torch.Tensor, image: int, batch: int = 0) -> torch.Tensor:
        """`values` over the keys on `image`'s real tiles put together as the processor cut them: [..., tile rows *
        patches, tile columns * patches], the class tokens dropped."""
        rows, cols = self.tiles[batch][image]
        grid = self.on_tiles(values, image)[..., : rows * cols, :, :]
        p = self.patches
        grid = grid.reshape(*values.shape[:-1], rows, cols, p, p).transpose(-3, -2)
        return grid.reshape(*values.shape[:-1], rows * p, cols * p)


@dataclass(frozen=True)
class MllamaPositions(Positions):
    """`Positions` of a Mllama prompt: each `<|image|>` token is an image's (kind "image", grid 1 x 1: the image is not
    in the sequence but in the cross-attention's keys), and `keys` says what each cross-attention key is."""

    keys: CrossKeys | None = field(default=None)


class MllamaImages(ImageTokens):
    """One `<|image|>` token (`config.image_token_index`) per image in the prompt; the image itself enters through the
    cross-attention blocks, as their keys (`CrossKeys`): its tiles (up to `vision_config.max_num_tiles`, as the
    processor cut the image, `aspect_ratio_ids` naming their layout) times each tile's class token and patches."""

    image_token = "image_token_index"

    def grid(self, config, inputs, image):
        return 1, 1

    def positions(self, config, input_ids, inputs):
        found = super().positions(config, input_ids, inputs)
        return MllamaPositions(**vars(found), keys=self.keys(config, inputs, found.kind.shape[0]))

    def keys(self, config, inputs: dict, batch: int) -> CrossKeys | None:
        """The layout of the cross-attention's keys for the processor's `pixel_values` [batch, images, tiles, ...],
        `aspect_ratio_ids` and `aspect_ratio_mask`; None without images."""
        pixels = inputs.get("pixel_values")
        if pixels is None:
            return None
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        per_tile = side * side + 1
        _, images, tiles = pixels.shape[:3]
        ratios = inputs.get("aspect_ratio_ids")
        mask = inputs.get("aspect_ratio_mask")
        k = torch.arange(images * tiles * per_tile)
        image, tile, patch = k // (tiles * per_tile), (k // per_tile) % tiles, k % per_tile
        patch_row = torch.where(patch > 0, (patch - 1) // side, -1)
        patch_col = torch.where(patch > 0, (patch - 1) % side, -1)
        found = {name: [] for name in ("tile_row", "tile_col", "real")}
        layouts = []
        for b in range(batch):
            own = []
            real = mask[b].bool().cpu() if mask is not None else torch.ones(images, tiles, dtype=torch.bool)
            tile_row, tile_col = torch.full((images, tiles), -1), torch.full((images, tiles), -1)
            for i in range(images):
                ratio = int(ratios[b, i]) if ratios is not None else 0
                if ratio == 0:  # a padding image
                    real[i] = False
                    continue
                rows, cols = vision.supported_aspect_ratios[ratio - 1]
                own.append((rows, cols))
                t = torch.arange(rows * cols)
                tile_row[i, : rows * cols], tile_col[i, : rows * cols] = t // cols, t % cols
            layouts.append(tuple(own))
            found["real"].append(real[image, tile])
            found["tile_row"].append(tile_row[image, tile])
            found["tile_col"].append(tile_col[image, tile])
        rows = {name: torch.stack(values) for name, values in found.items()}
        return CrossKeys(
            image=image.expand(batch, -1),
            tile=tile.expand(batch, -1),
            patch_row=patch_row.expand(batch, -1),
            patch_col=patch_col.expand(batch, -1),
            patches=side,
            tiles=tuple(layouts),
            **rows,
        )


def cross_attention_mask(config, cross_attention_mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The additive mask Mllama's cross-attention adds to its scores, [batch, 1, query, source], from the processor's
    `cross_attention_mask` [batch, seq, images, tiles] (1 where a token may see a tile): 0 where a token sees a key,
    the dtype's minimum where it does not, and 0 across a row that sees no key at all (a token before the first
    image: `MllamaModel` zeroes such rows' mask, so they attend to every key, padding tiles included, by their
    scores alone; the block then zeroes their MLP
    output, not their attention output). Written from the model's documented arithmetic, for the tests and analyses."""
    vision = config.vision_config
    per_tile = (vision.image_size // vision.patch_size) ** 2 + 1
    seen = cross_attention_mask.repeat_interleave(per_tile, dim=3).flatten(2).bool()[:, None]
    minimum = torch.finfo(dtype).min
    mask = torch.where(seen, 0.0, minimum).to(dtype)
    return torch.where(seen.any(-1, keepdim=True), mask, torch.zeros_like(mask))


CROSS_ONLY = (
    "layer {layer} of Mllama is a cross-attention block (config.cross_attention_layers): it has no self-attention; "
    "its attention is cross_attn, from the text to the vision tower's output"
)
SELF_ONLY = (
    "layer {layer} of Mllama is a self-attention block; its cross-attention blocks are layers "
    "{config.text_config.cross_attention_layers}"
)
RUNS_WITH_IMAGES = (
    "runs only on a prompt with images (pixel_values) or cross_attention_states: on text alone MllamaTextModel "
    "skips the block, and reading it fails"
)


class MllamaMultimodal(LanguageModelOf, MllamaBlocks):
    """Mllama's composite model (`MllamaForConditionalGeneration`), with images: its cross-attention blocks serve the
    cross-attention value set; the vision tower (`model.vision_model`) is mounted as two towers, `model.vision` (its
    local stack) and `model.vision_global` (its gated stack), run in that order (`families.vision_mllama`)."""

    model_types = ("mllama",)
    cross_attention = "cross_attn"
    cross_attention_norm = "input_layernorm"
    images = MllamaImages()
    towers = {
        "vision": Tower("model.vision_model.transformer", MllamaVisionTower),
        "vision_global": Tower("model.vision_model.global_transformer", MllamaGlobalTower),
    }
    serves_composite = True
    needs_images = "its cross-attention blocks run only beside images (tests/test_vlm_mllama.py gives them)"
    tiny = Tiny(
        "MllamaConfig",
        "MllamaForConditionalGeneration",
        {
            # the image token past the character tokenizer's 128 ids, so no text prompt holds one
            "text_config": {
                "model_type": "mllama_text_model",
                **TINY_DEFAULTS,
                **Mllama.tiny.kwargs,
                "vocab_size": 132,
            },
            "image_token_index": 129,
            "vision_config": {
                "model_type": "mllama_vision_model",
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_global_layers": 2,
                "attention_heads": 2,
                "intermediate_size": 64,
                "image_size": 32,  # 4 x 4 patches of 8 pixels per tile, and its class token: 17 keys per tile
                "patch_size": 8,
                "max_num_tiles": 2,
                "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
                "intermediate_layers_indices": [0],
                "vision_output_dim": 64,  # the last layer's output and one intermediate layer's, concatenated
            },
        },
    )
    vllm = Mllama.vllm  # the same words: vLLM dropped MllamaForConditionalGeneration

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "cross" not in kind:
            return locations
        probabilities, anchor = self.eager.probabilities
        scores, scores_anchor = self.eager.scores
        cross = {
            "cross_attention_input": ModuleInput(),  # no self-attention before it: the block's input
            "cross_attention_norm_output": ModuleOutput(self.cross_attention_norm),
            "cross_attention_queries": Operation((INTERFACE_CALL,), "arg", 1),
            "cross_attention_keys": Operation((INTERFACE_CALL,), "arg", 2),
            "cross_attention_values": Operation((INTERFACE_CALL,), "arg", 3),
            "cross_attention_scores": Operation((INTERFACE_CALL, scores), anchor=scores_anchor),
            "cross_attention_probabilities": Operation((INTERFACE_CALL, probabilities), anchor=anchor),
            "cross_attention_head_outputs": Operation((INTERFACE_CALL,), "output", 0),
            "cross_attention_premix": ModuleInput(self.output_projection),
            "cross_attention_output": ModuleOutput("", 0),
        }
        return {
            "embeddings": locations["embeddings"],
            "layer_input": ModuleInput(),
            **cross,
            **after_attention(self),
        }

    class Identities(identities.Identities):
        #: The rows that see no image: the cross block zeroes their MLP output (a keyword of the block's call).
        block_arguments = {"full_text_row_masked_out_mask": "full_text_row_masked_out_mask"}

        def residual_add(self, block, sublayer, stream, update, full_text_row_masked_out_mask=None, **arguments):
            if not hasattr(block, "cross_attn_attn_gate"):  # a self-attention block: Llama's
                return stream + update
            if sublayer == "cross_attention":
                return stream + block.cross_attn_attn_gate.tanh() * update
            if full_text_row_masked_out_mask is not None:
                update = full_text_row_masked_out_mask[:, 0] * update
            return stream + block.cross_attn_mlp_gate.tanh() * update

    kind_reasons = {
        "cross": {
            **{
                value.name: CROSS_ONLY
                for value in ALL_VALUES
                if value.scope == "attention" or value.name == "attention_norm_output"
            },
            **dict.fromkeys(
                (name for name in CACHE_VALUES if name in BY_NAME),
                CROSS_ONLY + "; its cache holds the vision states' keys and values, which attnlens does not serve",
            ),
        },
        "!cross": dict.fromkeys(WITH_CROSS_ATTENTION, SELF_ONLY),
    }
    kind_notes = {
        "*": {
            "embeddings": "the token embeddings (what layers[0] reads): an image enters through the cross-attention "
            "blocks' keys, not the sequence"
        },
        "!cross": {
            "attention_probabilities": "causal, over the text and the <|image|> tokens alike: an image enters "
            "through the cross-attention blocks' keys, not the sequence",
        },
        "cross": {
            "attention_probabilities": None,
            "layer_input": RUNS_WITH_IMAGES,
            "cross_attention_input": "the block's input (layer_input): a cross-attention block has no self-attention",
            "cross_attention_queries": "from the text, after q_norm (an RMS norm per head); no rotary embedding",
            "cross_attention_keys": "from the projected vision states, after k_norm: one key per image x tile x patch "
            "of the row (patch 0 of each tile its class token; model.positions(...).keys names each), from the vision "
            "tower's output (model.vision_global's last block, padding rows dropped, beside model.vision's blocks at "
            "intermediate_layers_indices)",
            "cross_attention_scores": "queries @ keys^T * scale + Mllama's cross-attention mask: a token sees the "
            "real tiles of the images from its own <|image|> token on (processor's cross_attention_mask); a row "
            "that sees none (a token before the first image) is unmasked: it attends to every key, padding tiles "
            "included, by its scores alone, as MllamaModel makes it",
            "cross_attention_probabilities": "each text position over the images' tile patches "
            "(model.positions(...).keys; .keys.on_image puts a row onto an image)",
            "cross_attention_output": "joins the stream scaled by tanh(cross_attn_attn_gate): layer_mid = "
            "layer_input + tanh(gate) * cross_attention_output",
            "layer_mid": "cross_attention_input + tanh(cross_attn_attn_gate) * cross_attention_output",
            "mlp_output": "zeroed on rows that see no image (full_text_row_masked_out_mask), then scaled by "
            "tanh(cross_attn_mlp_gate) as it joins the stream: layer_output = layer_mid + tanh(gate) * row mask * "
            "mlp_output",
        },
    }
