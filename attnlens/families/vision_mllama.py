"""Mllama's vision tower (`MllamaVisionModel`, `model.vision_model`): two stacks of ViT blocks run one after the
other over each image's tiles, served as two towers: `model.vision` (its `transformer`, the local blocks) and
`model.vision_global` (its `global_transformer`, the gated blocks).

The model cuts each image into up to `max_num_tiles` tiles (`aspect_ratio_ids` names their layout; an image with
fewer tiles, and a row's padding images, are filled with padding tiles, `aspect_ratio_mask` 0). Each tile's patch
embedding gets a gated aspect-ratio embedding, a class token in front, gated position and tile-position embeddings,
and `layernorm_pre`; then every tile is padded with zero rows to a multiple of 8 positions. Both stacks run over one
sequence per image (their batch axis is batch x images): its tiles one after another, each the class token, its
patch grid row-major, then the padding rows. A block is pre-norm (`input_layernorm`, `self_attn` with `q_proj`,
`k_proj`, `v_proj`, transformers' attention interface and `o_proj`; `post_attention_layernorm`, the MLP `fc1`,
`activation_fn`, `fc2`); a global block scales its attention and MLP outputs by `tanh(gate_attn)` and
`tanh(gate_ffn)` as they join the stream. Between the stacks: `layernorm_post`, then a gated post-tile aspect-ratio
embedding. The projector reads the global stack's output beside the local blocks' outputs at
`intermediate_layers_indices`, padding rows dropped.

Every position attends to every position of its image's sequence (all its tiles), except that the model masks the
pairs of two padding positions (a tile's padding rows, every position of a padding tile): a padding position sees
only real ones, a real position sees every position. The mask comes from `aspect_ratio_mask`, which the queries and
keys do not give: `MllamaVisionTower.segments` lays it out for the score function.
"""

from __future__ import annotations

import torch

from ..locations import ModuleInput
from ..parts import identities, scoring
from ..parts.sizes import Sizes, same_as
from .vision import SiglipTower

#: How the towers lay out an image's tiles in their sequence.
LAYOUT = (
    "one sequence per image (batch axis: batch x images, image-major), its max_num_tiles tiles one after another, "
    "each tile its class token, its patch grid row-major, then zero rows padding the tile to a multiple of 8 "
    "positions (a padding tile, aspect_ratio_mask 0, is padding throughout)"
)
MASK = (
    "every position sees every position of its image's tiles (all tiles together), except that two padding "
    "positions (a tile's padding rows, a padding tile's positions) do not see each other: a padding row sees the "
    "real positions only (the model's mask from aspect_ratio_mask, which the score function takes as "
    "segments(config, inputs, layer))"
)


def padding_rows(per_tile: int) -> int:
    """How many zero rows the model appends to each tile of `per_tile` positions: up to a multiple of 8."""
    return (8 - per_tile % 8) % 8


class MllamaVisionTower(SiglipTower):
    """Mllama's local stack (`MllamaVisionEncoder`, the vision model's `transformer`), as the tower `model.vision`."""

    layers = "layers"
    embed_tokens = None  # the stack is handed its input: `embeddings` is what its first block reads
    final_norm = None
    attention_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"
    output_projection = "o_proj"
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=(same_as("num_heads"),), head_dim=("head_dim",))
    absent = {
        **SiglipTower.absent,
        "final_norm_output": "the local stack ends at its last block: the vision model's layernorm_post normalises "
        "its output before the post-tile aspect-ratio embedding and the global stack (model.vision_global"
        ".embeddings is what that stack's first block reads)",
    }

    def locations(self):
        found = {**super().locations(), "embeddings": ModuleInput(f"{self.layers}.0")}
        del found["final_norm_output"]
        return found

    def segments(self, config, inputs: dict, layer: int) -> torch.Tensor:
        """[batch x images, positions]: 0 on a real position, -1 on a padding one (a tile's padding rows, a padding
        tile), from the processor's `aspect_ratio_mask` [batch, images, tiles] as the model builds its mask; what the
        score function takes as `image_of`. (`config`: the vision config.)"""
        tiles = torch.as_tensor(inputs["aspect_ratio_mask"]).cpu()
        per_tile = (config.image_size // config.patch_size) ** 2 + 1
        pad = padding_rows(per_tile)
        real = tiles.reshape(-1, tiles.shape[-1], 1).bool().expand(-1, -1, per_tile + pad).clone()
        real[:, :, -pad:] = False  # as the model slices it: with no padding rows (pad 0) this marks every position
        return torch.where(real.flatten(1), 0, -1)

    class ScoreFunction(scoring.Bidirectional):
        def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=None, device=None):
            dtype = dtype or torch.float32
            mask = super().mask(num_queries, num_keys, config, layer, key_mask, dtype, device)
            if self.image_of is None:  # no padding laid out: every position sees every position
                return mask
            padding = (self.image_of[:, :num_keys] < 0).to(mask.device)
            both = padding[:, num_keys - num_queries :, None] & padding[:, None, :]
            return torch.where(both[:, None], torch.finfo(dtype).min, mask)

        def beyond_queries_and_keys(self, config, layer):
            return (
                "the tower masks the pairs of padding positions, from aspect_ratio_mask, which the queries and keys "
                "do not give"
            )

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            if block.is_gated:  # a global block: tanh(gate_attn), tanh(gate_ffn) scale its sublayers' outputs
                update = (block.gate_attn if sublayer == "attention" else block.gate_ffn).tanh() * update
            return stream + update

    kind_notes = {
        "*": {
            "embeddings": "what the first local block reads: the patch embedding plus the gated aspect-ratio "
            "embedding, the class token in front, the gated position and tile-position embeddings, after "
            "layernorm_pre; " + LAYOUT,
            "layer_input": LAYOUT,
            "attention_probabilities": MASK,
            "attention_scores": "queries @ keys^T * scale, plus the dtype's minimum on pairs of two padding positions",
            "layer_output": "the outputs of the blocks in intermediate_layers_indices also reach the projector, "
            "concatenated with the global stack's output (padding rows dropped)",
        }
    }


class MllamaGlobalTower(MllamaVisionTower):
    """Mllama's gated stack (`MllamaVisionEncoder`, the vision model's `global_transformer`), as the tower
    `model.vision_global`: the local stack's blocks with each sublayer's output scaled by a tanh gate."""

    absent = {
        **SiglipTower.absent,
        "final_norm_output": "the global stack ends at its last block: the model drops the padding rows and "
        "concatenates its output with the local blocks' outputs at intermediate_layers_indices (vision_output_dim "
        "wide), which the multi_modal_projector reads; no norm follows",
    }

    kind_notes = {
        "*": {
            "embeddings": "what the first global block reads: the vision model's layernorm_post of the local "
            "stack's output (model.vision.layers[-1].layer_output) plus the gated post-tile aspect-ratio embedding; "
            + LAYOUT,
            "layer_mid": "layer_input + tanh(gate_attn) * attention_output",
            "layer_output": "layer_mid + tanh(gate_ffn) * mlp_output; the last block's, padding rows dropped, is "
            "what the projector reads (beside the local blocks' at intermediate_layers_indices)",
        }
    }
