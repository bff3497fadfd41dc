"""The vision towers of vision-language models: ViT encoders over an image's patches, served as the vision stack
`model.vision.layers[i]` of the multimodal model that holds them (`parts.multimodal.Tower`).

SigLIP (Gemma 3, PaliGemma, Idefics 3, SmolVLM, ...) and CLIP (LLaVA) build one block: pre-norm `layer_norm1`, the
attention (`q_proj`, `k_proj`, `v_proj`, transformers' attention interface, `out_proj`), the residual add, pre-norm
`layer_norm2`, the MLP (`fc1`, `activation_fn`, `fc2`), the residual add. Every patch attends to every patch (no
mask: an image's patches are all real). The tower's paths are from its own model (`SiglipVisionModel`: the blocks at
`encoder.layers`), which the multimodal model holds as its tower; `embeddings` is the patch embedding
with its positions added (what the first block reads, one row per patch, row-major over the patch grid), and
`final_norm_output` the tower's `post_layernorm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import Miswired
from ..family import Family, after_attention
from ..locations import (
    INTERFACE_CALL,
    Derived,
    Location,
    ModuleInput,
    ModuleOutput,
    Operation,
    mediator,
    softmax_argument,
)
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts import scoring
from ..parts.sizes import Sizes
from ..parts.vllm import VLLMLayout

TOWER_HAS_NO_LOGITS = "a vision tower has no logits: its last block's output (after final_norm_output) is what the "
TOWER_HAS_NO_LOGITS += "projector hands the language model"

#: A tiny recipe's CLIP or SigLIP tower, but for its `model_type`: 4 x 4 patches of 8 pixels, 2 blocks 32 wide.
TINY_TOWER = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
}


class PaddedPatches(scoring.Bidirectional):
    """A tower's scores where each image (view) of its batch may end in padding patches, masked as keys: every real
    patch sees every real patch of its image. `image_of` is the family's `segments` ([images, patches]: 0 on real
    patches, -1 on padding); the family's `padding_from` names the input that says which are padding."""

    def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None):
        mask = super().mask(num_queries, num_keys, config, layer, key_mask, dtype, device)
        if self.image_of is None:  # no padding given: every patch sees every patch
            return mask
        real = self.image_of[:, None, None, :num_keys].to(mask.device) >= 0
        return torch.where(real, mask, torch.finfo(mask.dtype).min)

    def beyond_queries_and_keys(self, config, layer):
        return (
            f"the tower masks each image's padding patches, which {self.family.padding_from} gives, not the queries "
            f"and keys"
        )


class SiglipTower(Family):
    """SigLIP's vision tower (`SiglipVisionModel`), as a stack of a multimodal model."""

    layers = "encoder.layers"
    embed_tokens = "embeddings"
    final_norm = "post_layernorm"
    attention_norm = "layer_norm1"
    mlp_norm = "layer_norm2"
    output_projection = "out_proj"
    activation = "activation_fn"
    down_projection = "fc2"
    sizes = Sizes(num_heads=("num_heads",), head_dim=("head_dim",), scale=("scale",))
    vllm = VLLMLayout(refusal="attnlens reads vision towers on the transformers engine only")
    ScoreFunction = scoring.Bidirectional

    def locations(self):
        found = {
            **super().locations(),
            "attention_scores": softmax_argument(INTERFACE_CALL),  # its eager function adds no mask: none is passed
            "layer_output": ModuleOutput(""),  # a block returns its hidden states
        }
        del found["logits"]
        return found

    kind_notes = {
        "*": {
            "embeddings": "the patch embedding with its learned positions added: one row per patch, row-major over "
            "the image's patch grid",
            "attention_probabilities": "bidirectional: every patch sees every patch of its image",
        }
    }
    kind_reasons = {
        "*": {
            "logits": TOWER_HAS_NO_LOGITS,
            **dict.fromkeys(CACHE_VALUES, "a vision tower caches nothing: it runs once over each image"),
        }
    }


class ClipTower(SiglipTower):
    """CLIP's vision tower (`CLIPVisionModel`, LLaVA's): SigLIP's block, a class embedding before the patches, a norm
    before the first block (`pre_layrnorm`), and a final norm (`post_layernorm`) over the class token's row alone.

    A vision-language model reads one block's output (LLaVA's `vision_feature_layer`, the second-to-last by default),
    not the tower's end: the blocks after it run, but nothing reads what they compute."""

    kind_notes = {
        "*": {
            "embeddings": "the class embedding then the patch embeddings, learned positions added, before "
            "pre_layrnorm: row 0 is the class token, then one row per patch, row-major over the patch grid; "
            "layers[0].layer_input is pre_layrnorm(embeddings)",
            "attention_probabilities": "bidirectional: every position (the class token and every patch) sees every "
            "position of its image",
            "layer_output": "a vision-language model reads one block's output, not the tower's end: LLaVA's "
            "projector reads hidden_states[vision_feature_layer] (its config's; -2 by default: the second-to-last "
            "block's layer_output; 0 would be layers[0].layer_input), the class token's row dropped under "
            "vision_feature_select_strategy 'default'; the blocks after it run, but nothing reads their outputs (an "
            "edit there changes nothing downstream)",
            "final_norm_output": "post_layernorm of the class token's row alone: one row per image (images x hidden, "
            "no sequence axis: CLIP's pooled output); a vision-language model's projector does not read it",
        }
    }
    kind_reasons = {
        "*": {
            "logits": "a vision tower has no logits: one block's output (LLaVA's vision_feature_layer) is what the "
            "projector hands the language model",
        }
    }

    def verify(self, model, layer, layer_module, attention_module):
        """A CLIP tower: its class embedding and `pre_layrnorm` are there (a SigLIP tower, some LLaVA checkpoints', has
        neither, and LLaVA's "default" strategy would drop a patch of it, not a class token)."""
        if not hasattr(model, "pre_layrnorm") or not hasattr(getattr(model, "embeddings", None), "class_embedding"):
            raise Miswired(
                f"family {self.name}: the tower is a {type(model).__name__}, no CLIP tower (no class embedding, no "
                f"pre_layrnorm); attnlens serves this model's tower as CLIP's only (a SigLIP-towered LLaVA is not "
                f"laid out: its feature strategy drops or keeps a patch, not a class token)"
            )
        super().verify(model, layer, layer_module, attention_module)


# --- Qwen's ViT (Qwen2-VL, Qwen2.5-VL) ---------------------------------------------------------------------------

QWEN_LAYOUT = (
    "one sequence of every image's patches, no batch axis in the model (served with a batch axis of one): "
    "the rows are the processor's pixel_values rows, block-major over spatial_merge_size x spatial_merge_size "
    "blocks of each image's patch grid, images one after another; on a prompt with videos and no images, "
    "pixel_values_videos' rows (each video frame after frame); with both, the model runs the tower on the images, "
    "then again on the videos, and a trace serves the first run (the images')"
)


def _batched(location: Location) -> Derived:
    """A tensor the tower holds as [patches, ...], served as [1, patches, ...] (a view: edits land)."""
    return Derived(
        location,
        view=lambda envoy, held: held.unsqueeze(0),
        unview=lambda envoy, held, new: new.reshape(held.shape),
    )


def _segment_ids(cu_seqlens, device=None):
    """[1, patches]: which segment (an image, or a window of one) each patch of the tower's sequence is in."""
    import torch

    cu = torch.as_tensor(cu_seqlens).long()
    return torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])[None].to(device)


@dataclass(frozen=True)
class PerSegment(Location):
    """The scores or the pattern of Qwen's tower on eager: it splits its sequence at `cu_seqlens` (images, or windows)
    and calls the attention function once per segment, in turn, each mixing its values before the next starts. The
    value is their assembly [1, heads, patches, patches]: segment `k`'s scores (pattern) on the diagonal block of its
    patches, the dtype's minimum (zero) elsewhere, which is what one call over the whole sequence with the
    block-diagonal mask would hold. Read-only: a pattern over all patches exists only once the last segment has run,
    after the earlier segments have used theirs. Scores and pattern are read together (segment by segment, as the
    forward reaches them), once per run."""

    part: str  #: "scores" or "probabilities"

    call: ClassVar[str] = "attention_interface_2"  # the per-segment call (the eager branch)
    in_place = False
    writable = False
    why_not = (
        "the tower runs one softmax per image (per window on windowed blocks), each mixing its values before the next "
        "starts; the pattern over all patches is their assembly, after all have run: edit queries, keys, values or "
        "attention_head_outputs (one tensor each), which the whole block uses"
    )

    @property
    def key(self) -> str:
        return f".source.{self.call}.segments"

    def read(self, envoy):
        import torch

        running = mediator()
        held = running.__dict__.setdefault("attnlens_segments", {})
        found = held.get(envoy.path)
        if found is None:
            found = held[envoy.path] = self._assembled(envoy, running, torch)
        return found[self.part]

    def _assembled(self, envoy, running, torch):
        lengths = Operation(("lengths_0",)).read(envoy).tolist()
        scores_at = Operation((self.call, "nn_functional_softmax_0"), "arg", 0)
        pattern_at = Operation((self.call, "attn_weights_3"))
        pinned = running.iteration
        pieces = []
        try:
            for k in range(len(lengths)):  # the k-th call of the function in this forward
                running.iteration = k
                pieces.append((scores_at.read(envoy), pattern_at.read(envoy)))
        finally:
            running.iteration = pinned
        total = sum(lengths)
        first = pieces[0][0]
        shape = (first.shape[0], first.shape[1], total, total)
        scores = torch.full(shape, torch.finfo(first.dtype).min, dtype=first.dtype, device=first.device)
        pattern = torch.zeros(shape, dtype=pieces[0][1].dtype, device=first.device)
        start = 0
        for length, (s, p) in zip(lengths, pieces):
            scores[:, :, start : start + length, start : start + length] = s
            pattern[:, :, start : start + length, start : start + length] = p
            start += length
        return {"scores": scores, "probabilities": pattern}

    def write(self, envoy, value):
        raise NotImplementedError  # read-only: Access refuses writes first


def _first_run_grids(inputs: dict):
    """The (t, h, w) grids of the tower's run that `model.vision` serves: the model runs its tower on the images
    (`pixel_values`, `image_grid_thw`), then again on the videos (`pixel_values_videos`, `video_grid_thw`); a trace
    reads the first run, the videos' where no images are given."""
    if inputs.get("pixel_values") is None and inputs.get("pixel_values_videos") is not None:
        return inputs["video_grid_thw"]
    return inputs["image_grid_thw"]


class QwenVisionTower(Family):
    """Qwen2-VL's ViT (`Qwen2VisionTransformerPretrainedModel`, `model.visual`): a 3-D convolution embeds each
    flattened patch (`pixel_values` [patches, C * T * P * P]); pre-norm blocks (LayerNorm `norm1`, attention with one
    fused `qkv` projection and 2-D rotary positions (each patch's row and column in its image), `proj`, LayerNorm
    `norm2`, MLP `fc1`, `act`, `fc2`); the merger (`ln_q`, then an MLP over each 2 x 2 block of patches) hands the
    language model one token per block.

    The model runs every image's patches as one sequence without a batch axis, and splits it at `cu_seqlens` (one
    segment per image) so that each patch attends to every patch of its own image and to no other. Served here as a
    batch of one: `[1, patches, hidden]` in the blocks, queries, keys and values `[1, heads, patches, head_dim]` (after
    the rotary positions), scores and pattern `[1, heads, patches, patches]` block-diagonal (`PerSegment`), head
    outputs `[1, patches, heads, head_dim]` (the function's per-segment outputs concatenated, as the model
    concatenates them)."""

    layers = "blocks"
    embed_tokens = "patch_embed"
    final_norm = None
    attention = "attn"
    attention_norm = "norm1"
    mlp_norm = "norm2"
    output_projection = "proj"
    activation = "act"
    down_projection = "fc2"
    fused_qkv = None
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_heads",), head_dim=("head_dim",), scale=("scaling",))
    vllm = VLLMLayout(refusal="attnlens reads vision towers on the transformers engine only")
    absent = {
        **Family.absent,
        "final_norm_output": "Qwen's tower ends at its last block: the merger (ln_q, then an MLP over each "
        "spatial_merge_size x spatial_merge_size block of patches) is the projector, not a final norm",
    }

    class ScoreFunction(scoring.Bidirectional):
        def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=None, device=None):
            import torch

            dtype = dtype or torch.float32
            mask = super().mask(num_queries, num_keys, config, layer, key_mask, dtype, device)
            if self.image_of is None:  # one segment: every patch sees every patch
                return mask
            # `image_of`: which segment each patch is in ([1, patches]: `QwenVisionTower.segments`)
            of = self.image_of.to(mask.device)
            together = of[:, num_keys - num_queries :, None] == of[:, None, :]
            return torch.where(together[:, None], mask, torch.finfo(dtype).min)

        def beyond_queries_and_keys(self, config, layer):
            return (
                "the tower's mask is block-diagonal over its images (windows) from the image grids (cu_seqlens), "
                "which the queries and keys do not give"
            )

    def segments(self, config, inputs: dict, layer: int):
        """[1, patches]: the segment each patch of `layer`'s sequence attends within (its image), from the
        grids given (`_first_run_grids`: the images', else the videos', each frame a segment of its own), as
        transformers' tower computes its `cu_seqlens`; the score function's `image_of`."""
        from transformers.vision_utils import get_vision_cu_seqlens

        return _segment_ids(get_vision_cu_seqlens(_first_run_grids(inputs)))

    def locations(self):
        found = {
            "embeddings": _batched(ModuleOutput(self.embed_tokens)),
            "layer_input": _batched(ModuleInput()),
            "attention_norm_output": _batched(ModuleOutput(self.attention_norm)),
            "attention_queries": Operation(("query_states_0",)),
            "attention_keys": Operation(("key_states_0",)),
            "attention_values": Operation(("value_states_0",)),
            "attention_scores": PerSegment("scores"),
            "attention_probabilities": PerSegment("probabilities"),
            "attention_head_outputs": Operation(("torch_cat_0",)),
            "attention_premix": _batched(ModuleInput(self.output_projection)),
            "attention_output": _batched(ModuleOutput("")),
        }
        tail = after_attention(self)
        for name in ("layer_mid", "mlp_norm_output", "mlp_input", "mlp_activation", "mlp_neurons", "mlp_output"):
            found[name] = _batched(tail[name])
        found["layer_output"] = _batched(ModuleOutput(""))
        return found

    kind_notes = {
        "*": {
            "embeddings": "the patch embedding (no learned positions: they are rotary, in the attention): "
            + QWEN_LAYOUT,
            "layer_input": QWEN_LAYOUT,
            "attention_queries": "after the 2-D rotary positions (each patch's row and column in its image)",
            "attention_keys": "after the 2-D rotary positions (each patch's row and column in its image)",
            "attention_key_positions": "each patch's index in the tower's sequence (not its rotary row and column)",
            "attention_probabilities": "block-diagonal: each patch sees every patch of its own image (of its own "
            "frame, on a video) and no other (the model runs one attention call per image or frame, split at "
            "cu_seqlens); read-only",
            "attention_scores": "block-diagonal: the dtype's minimum off the patch's own image (the model computes "
            "nothing there: it splits the sequence at cu_seqlens); read-only",
        }
    }
    kind_reasons = {
        "*": {
            "logits": TOWER_HAS_NO_LOGITS,
            **dict.fromkeys(CACHE_VALUES, "a vision tower caches nothing: it runs once over each image"),
        }
    }


class Qwen2_5VisionTower(QwenVisionTower):
    """Qwen2.5-VL's ViT: Qwen2-VL's with RMSNorm `norm1`/`norm2`, a gated MLP (`gate_proj`, `up_proj`, `act_fn`,
    `down_proj`), and windowed attention: before the first block the patches are reordered window by window
    (`window_index`: each window `window_size` pixels square, in merged 2 x 2 blocks), and every block but those in
    `fullatt_block_indexes` attends within each window only (`cu_window_seqlens`); the full-attention blocks within
    each image. The merger's output is put back in the processor's order.

    The blocks' sequence axis is the windowed order (the model's own), so `embeddings` (the patch embedding, before
    the reordering) is in the processor's order and `layers[0].layer_input` in the window order."""

    activation = "act_fn"
    down_projection = "down_proj"

    def segments(self, config, inputs, layer):
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

        grid = _first_run_grids(inputs)
        if layer in config.fullatt_block_indexes:
            return _segment_ids(get_vision_cu_seqlens(grid))
        _, windows = get_vision_window_index(grid, config.spatial_merge_size, config.window_size, config.patch_size)
        return _segment_ids(windows)

    kind_notes = {
        "*": {
            "embeddings": "the patch embedding in the processor's order (block-major over spatial_merge_size blocks), "
            "before the tower reorders its patches window by window for every block",
            "layer_input": "the tower's one sequence of patches in the window order (window_index: window by window, "
            "each window's merged blocks row-major), served with a batch axis of one",
            "attention_probabilities": "block-diagonal: on a windowed block each patch sees every patch of its own "
            "window (of a frame, on a video), on a full-attention block (fullatt_block_indexes) every patch of its "
            "own image (frame); the model runs one attention call per window (image, frame), split at cu_seqlens; "
            "read-only",
        }
    }
