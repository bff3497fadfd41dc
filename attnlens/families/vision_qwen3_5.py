"""Qwen3.5's ViT (`Qwen3_5VisionModel`, `model.visual` of `Qwen3_5ForConditionalGeneration` and of Qwen3.5-MoE's):
Qwen2-VL's tower (`vision.QwenVisionTower`: one sequence of every image's patches, a fused `qkv` projection, 2-D
rotary positions over each patch's row and column, one attention call per image split at `cu_seqlens`) with three
differences: learned positions added to the patch embedding before the first block (`pos_embed`: a square grid of
`num_position_embeddings`, bilinearly resampled to each image's patch grid), an MLP of `linear_fc1`, `act_fn`,
`linear_fc2`, and no deepstack: the merger (`merger`: LayerNorm, then an MLP over each `spatial_merge_size` x
`spatial_merge_size` block) reads the last block's output alone, and the language model reads nothing of the tower
but the merger's output in the image tokens' rows (Qwen3-VL's deepstack mergers, adding earlier blocks' features to
the first language-model layers' hidden states, are not in Qwen3.5).
"""

from __future__ import annotations

from dataclasses import replace

from ..locations import ModuleInput
from .vision import QWEN_LAYOUT, QwenVisionTower


class Qwen3_5VisionTower(QwenVisionTower):
    """Qwen3.5's ViT (`Qwen3_5VisionModel`): Qwen2-VL's blocks and segments, `embeddings` after the learned positions
    are added (the first block's input), the MLP's activation `act_fn` and down projection `linear_fc2`."""

    activation = "act_fn"
    down_projection = "linear_fc2"
    absent = {
        **QwenVisionTower.absent,
        "final_norm_output": "Qwen3.5's tower ends at its last block: the merger (a LayerNorm, then an MLP over each "
        "spatial_merge_size x spatial_merge_size block of patches) is the projector, not a final norm",
    }

    def locations(self):
        # what the first block reads: the patch embedding with the resampled learned positions added (in the model's
        # forward, not in a module of its own), batched as a block's input is
        found = super().locations()
        return {**found, "embeddings": replace(found["layer_input"], source=ModuleInput(f"{self.layers}.0"))}

    kind_notes = {
        "*": {
            **QwenVisionTower.kind_notes["*"],
            "embeddings": "the patch embedding with the learned positions added (pos_embed, bilinearly resampled to "
            "the image's patch grid; the rotary row and column positions come in the attention): " + QWEN_LAYOUT,
        }
    }
