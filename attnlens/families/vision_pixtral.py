"""Pixtral's vision tower (`PixtralVisionModel`: Mistral 3's, and Pixtral-12B's inside LLaVA), served as the vision
stack `model.vision.layers[i]` of the multimodal model that holds it (`parts.multimodal.Tower`).

The tower reads each image at its own size: `patch_conv` embeds the padded batch, each image's patch grid is cut to
its `image_sizes` (pixels over `patch_size`), and the grids are flattened row-major and concatenated into ONE sequence
with a batch axis of one ([1, patches of every image, hidden]), normed by `ln_pre`. Its blocks are Mistral's: RMSNorm
`attention_norm`, attention (`q_proj`, `k_proj`, `v_proj`, transformers' attention interface, `o_proj`), the residual
add, RMSNorm `ffn_norm`, a gated MLP `feed_forward` (`gate_proj`, `up_proj`, `act_fn`, `down_proj`), the residual add.
Queries and keys are rotated by a 2-D rotary (`patch_positional_embedding`: half the frequencies by the patch's row in
its image, half by its column), and the mask handed to the attention is block-diagonal (`generate_block_attention_mask`:
the dtype's minimum between images), so each patch attends to every patch of its own image and to none of another.
On eager that is one softmax over the whole sequence, the mask added to the scores: the pattern is one tensor, exact
zeros off each image's block.
"""

from __future__ import annotations

from ..family import Family
from ..locations import INTERFACE_CALL, ModuleInput, ModuleOutput, softmax_argument
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts.sizes import Sizes
from ..parts.vllm import VLLMLayout
from .vision import QwenVisionTower

PIXTRAL_LAYOUT = (
    "one sequence of every image's patches, batch axis of one: each image's patch grid (its image_sizes over "
    "patch_size) row-major, images one after another"
)


def patch_grids(config, inputs: dict) -> list[tuple[int, int]]:
    """(rows, columns) of patches of each image the tower reads, from the `image_sizes` given (pixels), else every
    image the padded `pixel_values`' full size, as `PixtralVisionModel` cuts them. `config`: the tower's."""
    sizes = inputs.get("image_sizes")
    if sizes is None:
        pixels = inputs["pixel_values"]
        sizes = [tuple(pixels.shape[-2:])] * pixels.shape[0]
    return [(int(height) // config.patch_size, int(width) // config.patch_size) for height, width in sizes]


class PixtralTower(Family):
    """Pixtral's vision tower (`PixtralVisionModel`), as a stack of a multimodal model: every image's patches one
    sequence of batch one, a 2-D rotary, a block-diagonal mask over images (the module docstring)."""

    layers = "transformer.layers"
    embed_tokens = "ln_pre"
    final_norm = None
    attention = "attention"
    mlp = "feed_forward"
    attention_norm = "attention_norm"
    mlp_norm = "ffn_norm"
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_heads",), head_dim=("head_dim",), scale=("scaling",))
    vllm = VLLMLayout(refusal="attnlens reads vision towers on the transformers engine only")
    absent = {
        **Family.absent,
        "final_norm_output": "Pixtral's tower ends at its last block: the norm after it (Mistral 3's projector's "
        "norm) belongs to the projector",
    }

    class ScoreFunction(QwenVisionTower.ScoreFunction):
        """Every patch sees every patch of its own image (`image_of`: the image of each patch, `segments`)."""

        def beyond_queries_and_keys(self, config, layer):
            return (
                "the tower's mask is block-diagonal over its images (from image_sizes), which the queries and keys do "
                "not give"
            )

    def segments(self, config, inputs: dict, layer: int):
        """[1, patches]: the image each patch of the tower's sequence is in (every block attends within images), from
        the `image_sizes` given, as the tower builds its block-diagonal mask; the score function's `image_of`."""
        import torch

        counts = torch.tensor([rows * cols for rows, cols in patch_grids(config, inputs)])
        return torch.repeat_interleave(torch.arange(len(counts)), counts)[None]

    def locations(self):
        found = {
            **super().locations(),
            "embeddings": ModuleInput(self.embed_tokens),
            # the eager function adds the block-diagonal mask to the scaled products before its softmax
            "attention_scores": softmax_argument(INTERFACE_CALL),
            "layer_output": ModuleOutput(""),  # a block returns its hidden states
        }
        del found["logits"], found["final_norm_output"]
        return found

    kind_notes = {
        "*": {
            "embeddings": "the patch embeddings before ln_pre (no learned positions: they are rotary, in the "
            "attention): " + PIXTRAL_LAYOUT + "; layers[0].layer_input is ln_pre(embeddings)",
            "layer_input": PIXTRAL_LAYOUT,
            "attention_queries": "after the 2-D rotary positions (each patch's row and column in its image)",
            "attention_keys": "after the 2-D rotary positions (each patch's row and column in its image)",
            "attention_key_positions": "each patch's index in the tower's sequence (not its rotary row and column)",
            "attention_scores": "block-diagonal: the scaled products plus the model's mask, the dtype's minimum off "
            "the patch's own image",
            "attention_probabilities": "block-diagonal: each patch sees every patch of its own image and no other "
            "(the model's mask over image_sizes); zero off its image",
            "layer_output": "Mistral 3's projector reads hidden_states[vision_feature_layer] (-1 by default: the last "
            "block's layer_output); the blocks after it, if any, run, but nothing reads their outputs",
        }
    }
    kind_reasons = {
        "*": {
            "logits": "a vision tower has no logits: one block's output (Mistral 3's vision_feature_layer, the last "
            "by default) is what the projector hands the language model",
            **dict.fromkeys(CACHE_VALUES, "a vision tower caches nothing: it runs once over each image"),
        }
    }
