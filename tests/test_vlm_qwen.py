"""Qwen2-VL and Qwen2.5-VL on the transformers engine: the language model with images (M-RoPE), what each position
is, and Qwen's ViT as `model.vision`, against transformers' own attention weights, a hand computation of the tower's
attention, and the identities.

The tiny models (`models.tiny("qwen2_vl")`, `models.tiny("qwen2_5_vl")`): a ViT over patches of 8 pixels (two frames
per patch, as the processor repeats an image), merged 2 x 2 into the language model's image tokens (id 129, between
130 and 131); a 3-block Qwen2 language model with 16-wide heads rotated by M-RoPE. Two images are built by hand as the
processor lays them out: 4 x 4 patches (2 x 2 tokens) and 6 x 4 patches (3 x 2 tokens). Qwen2.5-VL's tower attends
within windows of 2 x 2 tokens (16 patches) on blocks 0 and 2 (the second image is two windows, 16 and 8 patches),
within each image on block 1.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from images import logits_with_last_qwen_tower_block_uniform_within_each_image

import attnlens
from attnlens.checks import failures, read_everything

IMAGE, START, END = 129, 130, 131
#: Text, an image of 2 x 2 tokens, text, an image of 3 x 2 tokens, text.
PROMPT = torch.tensor([[1, 40, START, *[IMAGE] * 4, END, 42, START, *[IMAGE] * 6, END, 43, 44]])
FIRST, SECOND = [3, 4, 5, 6], [10, 11, 12, 13, 14, 15]
GRIDS = torch.tensor([[1, 4, 4], [1, 6, 4]])  # (t, h, w) in patches
PATCHES = 16 + 24
TYPES = ["qwen2_vl", "qwen2_5_vl"]


@pytest.fixture(scope="module", params=TYPES)
def model(request):
    return attnlens.models.tiny(request.param)


@pytest.fixture(scope="module")
def inputs():
    """The processor's outputs, by hand: one row per patch of C * T * P * P = 3 * 2 * 8 * 8 pixels."""
    pixels = torch.randn(PATCHES, 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(0))
    return {"pixel_values": pixels, "image_grid_thw": GRIDS, "mm_token_type_ids": (PROMPT == IMAGE).long()}


def _own(model, inputs):
    """The model's own run: its language model's attention weights, its logits, and per tower block the arguments
    its attention was called with (the segments `cu_seqlens`, the rotary `position_embeddings`) and its input."""
    seen = {}

    def keep(index):
        def hook(module, args, kwargs):
            seen[index] = (args[0], kwargs["cu_seqlens"], kwargs["position_embeddings"])

        return hook

    handles = [
        block.attn.register_forward_pre_hook(keep(i), with_kwargs=True)
        for i, block in enumerate(model._module.model.visual.blocks)
    ]
    try:
        with torch.no_grad():
            own = model._module(input_ids=PROMPT, output_attentions=True, **inputs)
            tower = model._module.model.visual(inputs["pixel_values"], grid_thw=GRIDS)
    finally:
        for handle in handles:
            handle.remove()
    return own, tower, seen


def test_every_language_pattern_equals_transformers_attention_on_a_prompt_with_two_images(model, inputs):
    """The language model's patterns on the two-image prompt (image rows causal, as the model's mask is) are
    torch.equal to `output_attentions`; the logits equal the model's."""
    own, _, _ = _own(model, inputs)
    language = []
    with torch.no_grad(), model.trace(PROMPT, **inputs):
        for i in range(model.num_layers):
            language.append(model.layers[i].self_attn.attention_probabilities.save())
        logits = model.logits.save()
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    first = language[1][0, :, FIRST][..., FIRST]
    below = torch.ones(4, 4, dtype=torch.bool).tril()
    assert (first[:, ~below] == 0).all() and (first[:, below] > 0).all()  # causal over an image's tokens


def test_the_towers_attention_equals_a_hand_computation_per_image_and_window(model, inputs):
    """transformers' tower returns no attention weights (its `attentions` are the attention modules' outputs), so
    each block's served values are checked against a hand computation from the block's own modules and the
    arguments the model called its attention with: queries and keys rotated by transformers' own vision rotary
    function, one softmax per segment of `cu_seqlens` (scaled products; within 1e-5), the pattern block-diagonal
    [1, heads, patches, patches] with exact zeros off the segments, head outputs the pattern times the values, and
    the last block's output the tower's output (torch.equal)."""
    from importlib import import_module

    _, tower, seen = _own(model, inputs)
    rotate = import_module(type(model._module).__module__).apply_rotary_pos_emb_vision
    read = {}
    with torch.no_grad(), model.trace(PROMPT, **inputs):
        for i in range(model.vision.num_layers):
            attn = model.vision.layers[i].self_attn
            read[i] = [
                attn.attention_queries.save(),
                attn.attention_keys.save(),
                attn.attention_values.save(),
                attn.attention_scores.save(),
                attn.attention_probabilities.save(),
                attn.attention_head_outputs.save(),
            ]
        last = model.vision.layers[-1].layer_output.save()
    assert torch.equal(last[0], tower.last_hidden_state)
    segments_seen = []
    for i, block in enumerate(model._module.model.visual.blocks):
        q, k, v, scores, pattern, heads = read[i]
        hidden, cu, (cos, sin) = seen[i]
        attn = block.attn
        with torch.no_grad():
            raw = attn.qkv(hidden).reshape(PATCHES, 3, attn.num_heads, -1).permute(1, 0, 2, 3)
            rq, rk = rotate(raw[0], raw[1], cos, sin)
        rq, rk, rv = (t.transpose(0, 1)[None] for t in (rq, rk, raw[2]))
        assert q.shape == (1, 2, PATCHES, 16) and torch.allclose(q, rq, atol=1e-5) and torch.allclose(k, rk, atol=1e-5)
        assert torch.allclose(v, rv, atol=1e-5)
        assert pattern.shape == scores.shape == (1, 2, PATCHES, PATCHES)
        expected = torch.zeros_like(pattern)
        bounds = cu.tolist()
        for start, end in itertools.pairwise(bounds):
            block_scores = rq[..., start:end, :] @ rk[..., start:end, :].transpose(-1, -2) * attn.scaling
            assert torch.allclose(scores[..., start:end, start:end], block_scores, atol=1e-5)
            expected[..., start:end, start:end] = block_scores.softmax(-1)
        assert torch.allclose(pattern, expected, atol=1e-5)
        assert (pattern[expected == 0] == 0).all() and (scores[expected == 0] == torch.finfo(scores.dtype).min).all()
        assert torch.allclose(heads, (pattern @ v).transpose(1, 2), atol=1e-5)
        segments_seen.append(len(bounds) - 1)
    # Qwen2-VL: every block within each image; Qwen2.5-VL: windows (3 of them) but on its full-attention block 1
    assert segments_seen == ([2, 2] if model.config.model_type == "qwen2_vl" else [3, 2, 3])


def test_the_identities_hold_on_both_stacks_with_images(model, inputs):
    """Every identity of every block of the tower (its segments from `image_grid_thw`, as transformers computes
    them) and of the language model (M-RoPE already in the queries and keys read) on the two-image prompt."""
    saved = read_everything(model, PROMPT, **inputs)
    tower = model.vision.num_layers
    assert [failures(model.vision, saved["vision"], i) for i in range(tower)] == [[]] * tower
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]


def test_one_softmax_over_all_patches_would_be_wrong(model, inputs):
    """Can fail: without the segments the checks hold the tower to every patch seeing every patch, and the zeros
    off each image (window) fail them, the family's scores (unmasked) too."""
    saved = read_everything(model, PROMPT, **inputs)
    for i in range(model.vision.num_layers):
        del saved["vision"][(i, "segments")]
    found = failures(model.vision, saved["vision"], 0)
    assert "visible entries positive" in found and "scores == family score function" in found


def test_positions_place_every_image_token_on_its_grid(model, inputs):
    """Each image's grid is its image_grid_thw row merged 2 x 2: 2 x 2 and 3 x 2 tokens, row-major."""
    found = model.positions(PROMPT, **inputs)
    spans = {"text": [0, 1, 8, 17, 18], "special": [2, 7, 9, 16], "image 0": FIRST, "image 1": SECOND}
    assert found.spans() == spans
    assert found.grids == (((2, 2), (3, 2)),)
    assert found.row[0, SECOND].tolist() == [0, 0, 1, 1, 2, 2] and found.col[0, SECOND].tolist() == [0, 1] * 3
    row = torch.arange(PROMPT.shape[1], dtype=torch.float32)
    assert found.on_grid(row, 1).tolist() == [[10.0, 11.0], [12.0, 13.0], [14.0, 15.0]]
    with pytest.raises(ValueError, match="image 1 of prompt 0 has 5 image tokens"):
        model.positions(PROMPT[:, :15], **inputs)


def test_key_positions_are_sequence_indices_not_the_rotary_positions(model, inputs):
    """`attention_key_positions` is each key's index in the sequence; M-RoPE's ids (the model's `get_rope_index`)
    differ after an image: its tokens take grid rows and columns, the text after it counts on from max(h, w) / 2 past
    the image's start. The support note says which is which."""
    with torch.no_grad(), model.trace(PROMPT, **inputs):
        positions = model.layers[0].self_attn.attention_key_positions.save()
    assert positions.tolist() == [list(range(PROMPT.shape[1]))]
    rope, _ = model._module.model.get_rope_index(PROMPT, inputs["mm_token_type_ids"], GRIDS)
    assert rope[:, 0, FIRST].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]  # (temporal, row, column)
    assert rope[:, 0, 7].tolist() == [5, 5, 5]  # the end token: 3 + max(2, 2), not 7
    assert "not its rotary position" in model.support(0).notes["self_attn.attention_key_positions"]


def test_an_edit_of_the_towers_head_outputs_moves_the_logits_as_recomputing_by_hand_predicts(model, inputs):
    """Uniform attention within each segment of the tower's last block, by assigning its head outputs (the pattern is
    read-only: the model mixes each segment before the next starts): the logits equal a hand-run of the model with
    that block's attention mixing the mean of each segment's values."""
    last = model.vision.layers[-1]
    ids = model.vision.family.segments(model.vision.config, inputs, model.vision.num_layers - 1)[0]
    bounds = [0, *torch.bincount(ids).cumsum(0).tolist()]
    with torch.no_grad(), model.trace(PROMPT, **inputs):
        values = last.self_attn.attention_values  # [1, heads, patches, head_dim]
        means = torch.stack([values[0, :, ids == s].mean(1) for s in range(len(bounds) - 1)])  # [segments, h, d]
        last.self_attn.attention_head_outputs = means[ids][None]  # [1, patches, heads, head_dim]
        edited = model.logits.save()
    expected = logits_with_last_qwen_tower_block_uniform_within_each_image(model, bounds, input_ids=PROMPT, **inputs)
    assert torch.allclose(edited, expected, atol=1e-5)
    with pytest.raises(attnlens.EditError, match="one softmax per image"):
        with torch.no_grad(), model.trace(PROMPT, **inputs):
            last.self_attn.attention_probabilities = torch.zeros(1, 2, PATCHES, PATCHES)
    support = model.vision.support(0)
    assert "no logits" in support["logits"] and "merger" in support["final_norm_output"]
