"""What the vision-language tests share: random images and a tiny processor's prompt over them, every served pattern
of both stacks read in one trace, a Qwen tower's own eager weights assembled per image, and hand computations (a
tower block run with uniform attention, over the whole sequence or within each image; each image token's embedding
against the projector's image of its patch; Pixtral's 2 x 2 patch merger)."""

from __future__ import annotations

import itertools
from importlib import import_module
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

import attnlens
from attnlens.parts.multimodal import KINDS

__all__ = [
    "image_tokens_hold_projected_features",
    "interleaved_mrope_axes",
    "logits_with_last_qwen_tower_block_uniform_within_each_image",
    "logits_with_uniform_tower_attention",
    "merged_2x2_projection",
    "Patterns",
    "patterns_beside_output_attentions",
    "pixtral_block_0_uniform_within_each_image",
    "processor_prompt",
    "random_image",
    "random_images",
    "resampled_learned_positions",
    "rotated_by_interleaved_mrope",
    "served_patterns",
    "tower_masks_two_images_from_each_other",
    "towers_own_weights_per_image",
]


def random_image(height: int, width: int, seed: int) -> Image.Image:
    """An RGB image of `height` x `width` pixels, uniform over 0..255, from its own generator seeded `seed`."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def random_images(*sizes: tuple[int, int], seed: int = 0) -> list[Image.Image]:
    """RGB images of the given (height, width) sizes, uniform over 0..255, drawn in turn from one generator."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def processor_prompt(processor, text: str, *sizes: tuple[int, int]):
    """The tensors `processor` (a family name for `models.tiny_processor`, or a processor) makes of `text` and
    `random_images(*sizes)`."""
    if isinstance(processor, str):
        processor = attnlens.models.tiny_processor(processor)
    return processor(text=text, images=random_images(*sizes), return_tensors="pt")


def served_patterns(model, prompt, tower: bool = True, **inputs):
    """In one trace of `prompt` (with `inputs`): every tower block's `attention_probabilities` (none where `tower` is
    False), every language-model layer's, and the logits; to hold against transformers' `output_attentions`."""
    vision, language = [], []
    with torch.no_grad(), model.trace(prompt, **inputs):
        if tower:
            for i in range(model.vision.num_layers):
                vision.append(model.vision.layers[i].self_attn.attention_probabilities.save())
        for i in range(model.num_layers):
            language.append(model.layers[i].self_attn.attention_probabilities.save())
        logits = model.logits.save()
    return vision, language, logits


class Patterns(NamedTuple):
    """Every tower block's pattern, every language-model layer's, and the logits."""

    vision: list
    language: list
    logits: torch.Tensor


def patterns_beside_output_attentions(model, tower, prompt, **inputs) -> tuple[Patterns, Patterns]:
    """The served patterns (`served_patterns`, one trace of `prompt` with `inputs`) and transformers' own: the
    attentions of `tower` (the model's tower module, called with `inputs` and output_attentions), and the model's
    `output_attentions` and logits on `prompt`."""
    with torch.no_grad():
        own = model._module(input_ids=prompt, output_attentions=True, **inputs)
        towers = tower(**inputs, output_attentions=True)
    return Patterns(*served_patterns(model, prompt, **inputs)), Patterns(towers.attentions, own.attentions, own.logits)


def resampled_learned_positions(visual, grid_thw) -> torch.Tensor:
    """By hand, a Qwen3-VL / Qwen3.5 ViT's learned positions (`visual.pos_embed`, a square grid) bilinearly resampled
    (corners aligned) to each image's patch grid of `grid_thw`, in the processor's order (2 x 2 blocks of patches
    row-major, each block row-major): [patches, width]."""
    side = int(visual.pos_embed.weight.shape[0] ** 0.5)
    grid = visual.pos_embed.weight.detach().T.reshape(1, -1, side, side)
    pieces = []
    for _, h, w in grid_thw.tolist():
        resampled = torch.nn.functional.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]
        order = [
            (2 * br + r, 2 * bc + c) for br in range(h // 2) for bc in range(w // 2) for r in range(2) for c in range(2)
        ]
        pieces.append(torch.stack([resampled[:, r, c] for r, c in order]))
    return torch.cat(pieces)


def interleaved_mrope_axes(config, rotary: int) -> list[int]:
    """Which position id turns each of the `rotary` / 2 frequencies under interleaved M-RoPE (`config` a text config
    with `rope_parameters["mrope_section"]`): frequency f by the row id (1) where f % 3 == 1 and f < 3 * section[1],
    the column id (2) where f % 3 == 2 and f < 3 * section[2], the temporal id (0) otherwise."""
    section = config.rope_parameters["mrope_section"]
    return [
        1 if f % 3 == 1 and f < 3 * section[1] else 2 if f % 3 == 2 and f < 3 * section[2] else 0
        for f in range(rotary // 2)
    ]


def rotated_by_interleaved_mrope(x, positions, config) -> torch.Tensor:
    """`x` [1, heads, seq, head_dim] rotated by hand by interleaved M-RoPE on `positions` [3, seq] (temporal, row,
    column): its first head_dim * partial_rotary_factor dimensions (the whole head where the config has no factor),
    each frequency by its axis's id (`interleaved_mrope_axes`); the rest passes unchanged."""
    rope = config.rope_parameters
    rotary = int(x.shape[-1] * rope.get("partial_rotary_factor", 1.0))
    frequencies = 1.0 / rope["rope_theta"] ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)
    axis = interleaved_mrope_axes(config, rotary)
    angles = positions[axis].T.float() * frequencies  # [seq, frequencies]: each frequency on its own axis's id
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    head = x[..., :rotary]
    half = torch.cat([-head[..., rotary // 2 :], head[..., : rotary // 2]], -1)
    return torch.cat([head * cos + half * sin, x[..., rotary:]], -1)


def logits_with_last_qwen_tower_block_uniform_within_each_image(model, bounds, **inputs):
    """By hand: the logits of `model`'s own module on `inputs` when the last block of its Qwen ViT
    (`model.visual.blocks[-1].attn`) gives each image's patches (`bounds`: the segments' cumulative ends, from 0) the
    mean of that image's values through `proj`; the block's `cu_seqlens` asserted equal to `bounds`."""
    module = model._module.model.visual.blocks[-1].attn

    def uniform(hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
        n = hidden_states.shape[0]
        v = module.qkv(hidden_states).reshape(n, 3, module.num_heads, -1)[:, 2]
        assert cu_seqlens.tolist() == bounds  # the model's own segments
        mixed = torch.cat([v[a:b].mean(0, keepdim=True).expand(b - a, -1, -1) for a, b in itertools.pairwise(bounds)])
        return module.proj(mixed.reshape(n, -1))

    original = module.forward
    module.forward = uniform
    try:
        with torch.no_grad():
            return model._module(**inputs).logits
    finally:
        module.forward = original


def towers_own_weights_per_image(model, inputs, monkeypatch, patches: int) -> list[torch.Tensor]:
    """A Qwen ViT's own attention weights (its `attentions` are not them): the weights transformers' eager function
    returns for each block, recorded per call (one call per image, asserted: two images), assembled block-diagonally
    into [1, heads, patches, patches]. (Run before reading every value: the function is patched in the module, which
    a forward nnsight has rewritten for reading inside it no longer calls.)"""
    module = import_module(type(model._module).__module__)
    blocks = [block.attn for block in model._module.model.visual.blocks]
    calls: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(blocks))}
    original = module.eager_attention_forward

    def recording(attention, *args, **kwargs):
        output, weights = original(attention, *args, **kwargs)
        for i, block in enumerate(blocks):
            if attention is block:
                calls[i].append(weights)
        return output, weights

    monkeypatch.setattr(module, "eager_attention_forward", recording)
    with torch.no_grad():
        model._module(**inputs)
    monkeypatch.undo()
    assembled = []
    for pieces in calls.values():
        whole = torch.zeros(1, pieces[0].shape[1], patches, patches)
        start = 0
        for piece in pieces:
            whole[..., start : start + piece.shape[-1], start : start + piece.shape[-1]] = piece
            start += piece.shape[-1]
        assert start == patches and len(pieces) == 2  # one call per image
        assembled.append(whole)
    return assembled


def tower_masks_two_images_from_each_other(model, prompt, first: int, **inputs) -> None:
    """Assert that on every block of `model.vision` (one sequence: the first image's `first` patches, then the
    second's) a patch's pattern is positive on its own image's patches and exactly zero on the other's, the scores
    between the images are the dtype's minimum (the model's mask added), and the first image has its own softmax."""
    a = first
    read = []
    with torch.no_grad(), model.trace(prompt, **inputs):
        for i in range(model.vision.num_layers):
            attn = model.vision.layers[i].self_attn
            read.append((attn.attention_scores.save(), attn.attention_probabilities.save()))
    for scores, pattern in read:
        assert (pattern[..., :a, :a] > 0).all() and (pattern[..., a:, a:] > 0).all()
        assert (pattern[..., :a, a:] == 0).all() and (pattern[..., a:, :a] == 0).all()
        assert (scores[..., :a, a:] == torch.finfo(scores.dtype).min).all()
        assert torch.allclose(pattern[..., :a, :a].sum(-1), torch.ones(1, 2, a))  # each image its own softmax


def merged_2x2_projection(projector, normed, image: int, row: int, col: int, starts, widths) -> torch.Tensor:
    """By hand, Pixtral's projector at the image token of grid (`row`, `col`) of image `image`: the merging layer over
    the 2 x 2 patches (2 row + i, 2 col + j) of `normed` (the tower's last block output through `projector.norm`,
    [patches, width]; image k's patches from `starts[k]`, `widths[k]` a row), channel-major as torch's unfold lays
    them, then the two linear layers."""
    patches = [starts[image] + (2 * row + i) * widths[image] + 2 * col + j for i in range(2) for j in range(2)]
    merged = projector.patch_merger.merging_layer(normed[patches].T.reshape(-1))
    return projector.linear_2(projector.act(projector.linear_1(merged)))


def pixtral_block_0_uniform_within_each_image(model, tower, patches, prompt, heads: int = 2, **inputs):
    """Uniform attention within each image in block 0 of the Pixtral `tower` (the model's module; `patches`: each
    image's patch count, one sequence). Returns three logits of `prompt` (with `inputs`): served with block 0's
    pattern written ([1, `heads`, n, n], 1 / patches on each image's block, zero between); by hand, a forward hook
    making the block's attention the mean of each image's values through o_proj; and unedited."""
    ends = list(itertools.accumulate(patches))
    bounds = list(zip([0, *ends[:-1]], ends))
    uniform = torch.zeros(1, heads, ends[-1], ends[-1])
    for a, b in bounds:
        uniform[..., a:b, a:b] = 1 / (b - a)
    with torch.no_grad(), model.trace(prompt, **inputs):
        model.vision.layers[0].self_attn.attention_probabilities = uniform
        edited = model.logits.save()
    module = tower.transformer.layers[0].attention

    def mean_per_image(hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        values = module.v_proj(hidden_states)
        mixed = torch.cat([values[:, a:b].mean(1, keepdim=True).expand(-1, b - a, -1) for a, b in bounds], 1)
        return module.o_proj(mixed), None

    handle = module.register_forward_hook(
        lambda m, args, kwargs, out: mean_per_image(*args, **kwargs), with_kwargs=True
    )
    try:
        with torch.no_grad():
            by_hand = model._module(input_ids=prompt, **inputs).logits
    finally:
        handle.remove()
    with torch.no_grad():
        plain = model._module(input_ids=prompt, **inputs).logits
    return edited, by_hand, plain


def logits_with_uniform_tower_attention(model, block: int, prompt, **inputs):
    """By hand: the logits of `model`'s own module on `prompt` (with `inputs`) when block `block` of its CLIP or
    SigLIP tower (`model.vision_tower.encoder.layers`) attends uniformly, every position receiving the mean of the
    values through `out_proj`."""
    module = model._module.model.vision_tower.encoder.layers[block].self_attn

    def uniform(attention, hidden_states, attention_mask=None, **kwargs):
        b, n, _ = hidden_states.shape
        values = attention.v_proj(hidden_states).view(b, n, -1, attention.head_dim)
        mixed = values.mean(1, keepdim=True).expand(b, n, -1, -1).reshape(b, n, -1)
        return attention.out_proj(mixed), None

    original = module.forward
    module.forward = lambda *a, **k: uniform(module, *a, **k)
    try:
        with torch.no_grad():
            return model._module(input_ids=prompt, **inputs).logits
    finally:
        module.forward = original


def image_tokens_hold_projected_features(model, prompt, features, first_patch: int = 0, **inputs) -> list[int]:
    """Assert that the language model's input at each image token of `prompt` (row 0) is, within 1e-6, the
    projector's image of the tower's features (`features(model.vision)`: the value the projector reads, [image,
    place, width]) at the token's place: 0 for a class token (kind "class"), `first_patch + row * columns + col` for
    the patch of its grid row and column. Returns the positions checked, for the caller to hold against its own."""
    with torch.no_grad(), model.trace(prompt, **inputs):
        read = features(model.vision).save()
        first = model.layers[0].layer_input.save()
    found = model.positions(prompt, **inputs)
    projector = model._module.model.multi_modal_projector
    kinds = found.kind[0].tolist()
    checked = (found.image[0] >= 0).nonzero().flatten().tolist()
    with torch.no_grad():
        for at in checked:
            image, r, c = (int(t[0, at]) for t in (found.image, found.row, found.col))
            columns = found.grids[0][image][1]
            place = 0 if kinds[at] == KINDS.index("class") else first_patch + r * columns + c
            assert torch.allclose(first[0, at], projector(read[image, place]), atol=1e-6)
    return checked
