"""Qwen3-VL's ViT (`Qwen3VLVisionModel`, `model.visual` of `Qwen3VLForConditionalGeneration` and of Qwen3-VL-MoE's):
Qwen3.5's tower (`Qwen3_5VisionTower`: Qwen2-VL's blocks, learned positions resampled into what the first block reads,
an MLP of `linear_fc1`, `act_fn`, `linear_fc2`) with deepstack: beside the merger over the last block's output, one
merger per block of `deepstack_visual_indexes` (`deepstack_merger_list[k]`: a LayerNorm over each
`spatial_merge_size` x `spatial_merge_size` block of patches concatenated, then an MLP) reads that block's output, the
block's `layer_output` served here as every block's is; the language model adds merger `k`'s output to the image
tokens' rows of the residual stream after its block `k` (`qwen3_vl.Qwen3VL`).
"""

from __future__ import annotations

from .vision_qwen3_5 import Qwen3_5VisionTower


class Qwen3VLVisionTower(Qwen3_5VisionTower):
    """Qwen3-VL's ViT (`Qwen3VLVisionModel`): Qwen3.5's blocks and positions; the deepstack mergers read the outputs
    of the blocks in `deepstack_visual_indexes`, which are served as any block's."""

    absent = {
        **Qwen3_5VisionTower.absent,
        "final_norm_output": "Qwen3-VL's tower ends at its last block: the merger (a LayerNorm, then an MLP over each "
        "spatial_merge_size x spatial_merge_size block of patches) is the projector, not a final norm, and the "
        "deepstack mergers (deepstack_merger_list) project the outputs of the blocks in deepstack_visual_indexes",
    }

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        indexes = list(getattr(config, "deepstack_visual_indexes", None) or [])
        if layer is not None and layer in indexes:
            k = indexes.index(layer)
            notes["layer_output"] = (
                f"the block's output, which the next block and deepstack merger {k} (deepstack_merger_list[{k}]) "
                f"read: the language model adds that merger's output to the image tokens' rows after its layer {k}"
            )
        return notes
