"""Gemma 4's vision tower (`Gemma4VisionModel`, `model.vision_tower`), served as the vision stack `model.vision` of a
"gemma4" model.

The processor resizes each image, keeping its aspect ratio, to the largest size whose patches (`patch_size` pixels
square) fit a budget (`max_soft_tokens * pooling_kernel_size**2`) with both sides a multiple of
`pooling_kernel_size * patch_size`, flattens the patches row-major (`pixel_values` [images, max_patches, 3 * P * P])
and pads each image to the budget with patches at position (-1, -1) (`image_position_ids` [images, max_patches, 2]:
each patch's column x and row y). So images have grids of their own, and most have padding patches.

- The patch embedder projects each patch (`input_proj`, after `2 * (pixels - 0.5)`) and adds a learned position for
  its column and one for its row (`position_embedding_table`); a padding patch gets no position.
- Each block is Gemma's: `input_layernorm`, the attention, `post_attention_layernorm`, the residual add;
  `pre_feedforward_layernorm`, a gated MLP (`gate_proj`, `up_proj`, `act_fn`, `down_proj`),
  `post_feedforward_layernorm`, the residual add (RMSNorms throughout; linears wrapped in `Gemma4ClippableLinear`,
  which may clamp their inputs and outputs).
- The attention: `q_norm`, `k_norm` on each head, then a 2-D rotary embedding (the first half of each head rotated by
  the patch's column, the second by its row: `apply_multidimensional_rope`); values after `v_norm` (an RMSNorm
  without weights); scores unscaled (`scaling = 1.0`). Every patch sees every real patch of its image, padding
  patches as keys are masked (`create_bidirectional_mask` over `image_position_ids != -1`); a padding patch's own row
  attends to the real patches too, and nothing downstream reads it.
- After the last block the pooler averages each `pooling_kernel_size` square of patches into one soft token
  (row-major over the pooled grid), scales by `sqrt(hidden_size)`, drops the padding, and `embed_vision` (an RMSNorm
  without weights, a linear) hands them to the language model: no final norm inside the tower.
"""

from __future__ import annotations

import torch

from ..parts.sizes import Sizes
from .gemma2 import Gemma2
from .vision import PaddedPatches, SiglipTower


def real_patches(image_position_ids) -> torch.Tensor:
    """[images, max_patches] bool: the patches that hold an image (not the processor's padding at (-1, -1))."""
    return (torch.as_tensor(image_position_ids) != -1).all(-1)


class Gemma4VisionTower(SiglipTower):
    """Gemma 4's vision tower (`Gemma4VisionModel`), as a stack of a multimodal model: see the module's docstring."""

    layers = "encoder.layers"
    embed_tokens = "patch_embedder"
    final_norm = None
    attention_norm = "input_layernorm"
    attention_post_norm = "post_attention_layernorm"
    mlp_norm = "pre_feedforward_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"
    output_projection = "o_proj"
    activation = "act_fn"
    down_projection = "down_proj"
    sizes = Sizes()  # config.num_attention_heads, config.num_key_value_heads, head_dim, scaling (1.0)
    eager = Gemma2.eager  # the eager function of Gemma 4's file: a soft-cap branch (never taken) before the mask

    ScoreFunction = PaddedPatches
    padding_from = "image_position_ids"

    def segments(self, config, inputs: dict, layer: int) -> torch.Tensor:
        """[images, patches]: 0 on each image's real patches, -1 on its padding, from the `image_position_ids` given,
        as the tower builds its mask; the score function's `image_of`."""
        return torch.where(real_patches(inputs["image_position_ids"]), 0, -1)

    def locations(self):
        found = super().locations()
        del found["final_norm_output"]
        return found

    absent = {
        **SiglipTower.absent,
        "final_norm_output": "Gemma 4's tower ends at its last block: the pooler (an average over each "
        "pooling_kernel_size square of patches, times sqrt(hidden_size)) and embed_vision (an RMSNorm without "
        "weights, a linear) come after it, no final norm",
    }

    kind_notes = {
        "*": {
            "embeddings": "input_proj(2 * (pixels - 0.5)) plus the learned positions of the patch's column and row: "
            "one row per patch, row-major over the image's patch grid as the processor resized it, then the "
            "padding patches (position (-1, -1): no position added) up to max_patches",
            "attention_queries": "after q_norm (RMSNorm) and the 2-D rotary positions (the first half of each head "
            "by the patch's column, the second by its row)",
            "attention_keys": "after k_norm (RMSNorm) and the 2-D rotary positions (the first half of each head by "
            "the patch's column, the second by its row)",
            "attention_values": "after v_norm (an RMSNorm without weights)",
            "attention_scores": "not scaled (scaling 1.0): q_norm and k_norm set the scale; the dtype's minimum at "
            "padding patches' keys",
            "attention_probabilities": "bidirectional: every patch sees every real patch of its image, none of its "
            "padding (the rows of padding patches attend to the real patches too; the pooler drops them)",
            "layer_output": "the last block's is what the pooler averages (each pooling_kernel_size square of "
            "patches, times sqrt(hidden_size)) before embed_vision hands it to the language model",
        }
    }
