"""Llama 4's vision tower (`Llama4VisionModel`, the multimodal model's `vision_model`), served as `model.vision`.

Each tile of an image (`pixel_values` [tiles, channels, height, width]: every image's tiles, then its global view
where it has several) is one row of the tower's batch. The patches are unfolded and projected (`patch_embedding`), a
class embedding is appended after them (the last row, not the first), learned positions are added and `layernorm_pre`
normalises; pre-norm blocks (LayerNorm `input_layernorm`, attention with `q_proj`, `k_proj`, `v_proj` and a 2-D
rotary embedding on queries and keys, `o_proj`, the residual add, LayerNorm `post_attention_layernorm`, MLP `fc1`,
GELU `activation_fn`, `fc2`, the residual add) attend bidirectionally over a tile's patches and its class token; then
`layernorm_post`, the class token's row dropped, and the adapter (`vision_adapter`: a pixel shuffle folding each 2 x 2
block of patches into one token of four times the width, then a two-layer GELU MLP) before the multimodal projector.

The rotary embedding rotates adjacent channel pairs (complex multiplication, as the text model's does): the first
half of each head's pairs by the patch's column + 1, the second half by its row + 1, over the patch grid of the
tower's `image_size`; the class token is not rotated (its angles are zero). Queries and keys are served after it, as
the attention function receives them; the scores are `queries @ keys^T * head_dim^-0.5` (the eager function's own
scale, `scaling` on the module), no mask.
"""

from __future__ import annotations

from ..locations import Derived, ModuleInput, ModuleOutput
from ..parts.sizes import Sizes
from .vision import SiglipTower

#: How a tile's rows are laid out in the tower.
TILE_LAYOUT = "one row per patch of the tile, row-major over its patch grid, then the class token (the last row)"


class Llama4VisionTower(SiglipTower):
    """Llama 4's vision tower (`Llama4VisionModel`), as a stack of the multimodal model."""

    layers = "model.layers"
    embed_tokens = "patch_embedding"
    final_norm = "layernorm_post"
    attention_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"
    output_projection = "o_proj"
    # the eager function scales by head_dim ** -0.5 itself (the call passes scaling=None)
    sizes = Sizes(num_heads=("num_heads",), head_dim=("head_dim",), scale=(lambda module, _: module.head_dim**-0.5,))

    def locations(self):
        found = super().locations()
        return {
            # what layernorm_pre reads: [tiles, 1, patches + 1, hidden] in the model (its chunk axis of one), served
            # without that axis (a view: edits land)
            "embeddings": Derived(
                ModuleInput("layernorm_pre"),
                view=lambda envoy, held: held.squeeze(1),
                unview=lambda envoy, held, new: new.reshape(held.shape),
            ),
            **{name: found[name] for name in found if name != "embeddings"},
            "attention_output": ModuleOutput("", 0),  # the attention returns (output, weights)
            "layer_output": ModuleOutput("", 0),  # a block returns (hidden states,)
        }

    kind_notes = {
        "*": {
            "embeddings": "the patch embeddings, the class embedding appended after them, learned positions added, "
            f"before layernorm_pre: {TILE_LAYOUT}; one batch row per tile; layers[0].layer_input is "
            "layernorm_pre(embeddings)",
            "attention_queries": "after the 2-D rotary embedding (adjacent channel pairs: the first half of each "
            "head's pairs turned by the patch's column + 1, the second half by its row + 1; the class token unturned)",
            "attention_keys": "after the 2-D rotary embedding, as the queries",
            "attention_key_positions": "each row's index in the tile (the rotary angles come from the patch's row "
            "and column, the class token last)",
            "attention_probabilities": "bidirectional: every row (the tile's patches and its class token) sees every "
            "row of its tile; each tile is a batch row of its own",
            "final_norm_output": f"layernorm_post over every row ({TILE_LAYOUT}); the model then drops the class "
            "token's row and hands the patches to the adapter (a 2 x 2 pixel shuffle and an MLP) and the projector",
        }
    }
