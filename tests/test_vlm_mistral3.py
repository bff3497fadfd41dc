"""Mistral 3 on the transformers engine: a prompt with two images of different sizes, what each position is, the
Pixtral tower's own attention (2-D rotary, block-diagonal over images), against transformers' own attention weights,
hand recomputations of the rotary, the merger and an edit, and the identities.

The tiny Mistral 3 (`models.tiny("mistral3")`) and its processor (`models.tiny_processor("mistral3")`, built here): a
2-block Pixtral tower (patches of 4 pixels, 2 heads of 16) whose output (`vision_feature_layer` -1) the projector
merges 2 x 2, a 3-block Mistral language model whose image tokens ([IMG], id 129; [IMG_BREAK] 130 after each row but
the last, [IMG_END] 131 after the last) attend causally. The prompt's images: 32 x 32 pixels (8 x 8 patches, 4 x 4
tokens) and 16 x 24 (4 x 6 patches, 2 x 3 tokens): the tower's one sequence is 64 + 24 patches.
"""

from __future__ import annotations

import pytest
import torch
from images import (
    merged_2x2_projection,
    patterns_beside_output_attentions,
    pixtral_block_0_uniform_within_each_image,
    processor_prompt,
    tower_masks_two_images_from_each_other,
)

import attnlens
from attnlens.checks import failures, read_everything

IMAGE, BREAK, END = 129, 130, 131
PATCHES = (64, 24)
FIRST = [1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 16, 17, 18, 19]
SECOND = [22, 23, 24, 26, 27, 28]


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("mistral3")


@pytest.fixture(scope="module")
def prompt():
    """The processor's output for text, a 32 x 32 image, text, a 16 x 24 image, text."""
    return processor_prompt("mistral3", "A[IMG]B[IMG]C", (32, 32), (16, 24))


def _inputs(prompt):
    return {"pixel_values": prompt["pixel_values"], "image_sizes": prompt["image_sizes"]}


def test_the_processor_lays_each_image_out_row_by_row_with_break_and_end_tokens(prompt):
    """Built locally: the images' sizes kept (multiples of the merged patch, 8 pixels), padded to one batch; 4 rows
    of 4 [IMG] and 2 rows of 3, each row ended by [IMG_BREAK], the last by [IMG_END]."""
    assert prompt["image_sizes"].tolist() == [[32, 32], [16, 24]]
    assert prompt["pixel_values"].shape == (2, 3, 32, 32)
    row = lambda n, last: [IMAGE] * n + [last]  # noqa: E731
    first = row(4, BREAK) * 3 + row(4, END)
    second = row(3, BREAK) + row(3, END)
    assert prompt["input_ids"].tolist() == [[36, *first, 37, *second, 38]]


def test_every_pattern_of_both_stacks_equals_transformers_attention_on_a_prompt_with_two_images(model, prompt):
    """The tower's patterns ([1, heads, 88, 88]: both images' patches one sequence) and the language model's (image
    rows causal, as text) are torch.equal to `output_attentions`; the logits equal the model's."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    (vision, language, logits), own = patterns_beside_output_attentions(
        model, model._module.model.vision_tower, ids, **inputs
    )
    assert len(vision) == len(own.vision) == 2 and len(language) == len(own.language) == 3
    assert all(torch.equal(found, expected) for found, expected in zip(vision, own.vision))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.language))
    assert torch.equal(logits, own.logits)
    assert vision[0].shape == (1, 2, 88, 88)
    first = language[1][0][:, FIRST][..., FIRST]
    seen = torch.ones(16, 16, dtype=torch.bool).tril()
    assert (first[:, ~seen] == 0).all() and (first[:, seen] > 0).all()  # an image's tokens: causal, as text


def test_the_towers_mask_is_block_diagonal_each_patch_seeing_its_own_image_alone(model, prompt):
    """On every block, a patch's pattern is positive on its own image's patches and exactly zero on the other
    image's; the scores off the blocks are the dtype's minimum (the model's mask added)."""
    tower_masks_two_images_from_each_other(model, prompt["input_ids"], PATCHES[0], **_inputs(prompt))


def test_the_identities_hold_on_both_stacks_with_images(model, prompt):
    """Every identity of every block of the tower (its segments: each patch's image, from image_sizes) and of the
    language model, the image rows causal."""
    saved = read_everything(model, prompt["input_ids"], **_inputs(prompt))
    assert [failures(model.vision, saved["vision"], i) for i in range(2)] == [[], []]
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    assert saved["vision"][(0, "segments")].tolist() == [[0] * 64 + [1] * 24]
    assert saved["vision"]["embeddings"].shape == (1, 88, 32)


def test_a_tower_whose_images_saw_each_other_would_fail(model, prompt):
    """Can fail: held to every patch seeing every patch (no segments: one image), the checks find the zeros between
    the images and the family's unmasked scores; the language model held to images seen both ways fails too."""
    saved = read_everything(model, prompt["input_ids"], **_inputs(prompt))
    for i in range(2):
        del saved["vision"][(i, "segments")]
    found = failures(model.vision, saved["vision"], 0)
    assert "visible entries positive" in found and "scores == family score function" in found


def test_queries_and_keys_are_rotated_by_each_patchs_row_and_column_in_its_own_image(model, prompt):
    """By hand: block 0's queries and keys are its projections of `attention_norm(layer_input)` rotated by the
    tower's rotary at (row, column) of the patch within its image (rows restart at the second image), within 1e-5;
    rotated by sequence indices instead they differ."""
    from transformers.models.pixtral.modeling_pixtral import apply_rotary_pos_emb

    with torch.no_grad(), model.trace(prompt["input_ids"], **_inputs(prompt)):
        normed = model.vision.layers[0].attention_norm_output.save()
        queries = model.vision.layers[0].self_attn.attention_queries.save()
        keys = model.vision.layers[0].self_attn.attention_keys.save()
    tower = model._module.model.vision_tower
    module = tower.transformer.layers[0].attention
    places = [(r, c) for rows, cols in ((8, 8), (4, 6)) for r in range(rows) for c in range(cols)]
    with torch.no_grad():
        q = module.q_proj(normed).view(1, 88, 2, 16).transpose(1, 2)
        k = module.k_proj(normed).view(1, 88, 2, 16).transpose(1, 2)
        cos, sin = tower.patch_positional_embedding(normed, torch.tensor(places))
        rq, rk = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)
        flat = torch.stack([torch.arange(88), torch.zeros(88, dtype=torch.long)], -1)
        wrong, _ = apply_rotary_pos_emb(q, k, *tower.patch_positional_embedding(normed, flat), unsqueeze_dim=0)
    assert torch.allclose(queries, rq, atol=1e-5) and torch.allclose(keys, rk, atol=1e-5)
    assert not torch.allclose(queries, wrong, atol=1e-2)


def test_positions_place_every_image_token_on_its_images_merged_grid(model, prompt):
    """Grids from image_sizes over 4 * 2 pixels: 4 x 4 and 2 x 3, row-major; [IMG_BREAK] and [IMG_END] special;
    image_sizes missing, or a prompt without the break tokens, refused naming the field."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    found = model.positions(ids, **inputs)
    assert found.spans() == {
        "text": [0, 21, 30],
        "special": [5, 10, 15, 20, 25, 29],
        "image 0": FIRST,
        "image 1": SECOND,
    }
    assert ids[0, found.spans()["special"]].tolist() == [BREAK, BREAK, BREAK, END, BREAK, END]
    assert found.grids == (((4, 4), (2, 3)),)
    assert found.row[0, SECOND].tolist() == [0, 0, 0, 1, 1, 1] and found.col[0, SECOND].tolist() == [0, 1, 2] * 2
    assert found.on_grid(torch.arange(31.0), 1).tolist() == [[22.0, 23.0, 24.0], [26.0, 27.0, 28.0]]
    assert model.positions(prompt).grids == found.grids  # the processor's output as a whole
    with pytest.raises(ValueError, match=r"image_sizes: .* pass the processor's image_sizes"):
        model.positions(ids, pixel_values=inputs["pixel_values"])
    with pytest.raises(ValueError, match=r"image 0 of prompt 0 is not laid out as 4 rows of 4"):
        model.positions(ids[ids != BREAK][None], **inputs)
    with pytest.raises(ValueError, match="image 1 of prompt 0 has 5 image tokens"):
        model.positions(ids[:, :28], **inputs)


def test_each_image_token_holds_the_merged_projected_feature_of_its_2x2_patches(model, prompt):
    """By hand: the language model's input at the image token of grid (row, col) is the projector (norm, the
    merging layer over the 2 x 2 patches (2 row + i, 2 col + j) of the tower's last block output, channel-major as
    torch's unfold lays them, two linear layers) at that block, within 1e-5; the break and end tokens hold their own
    embeddings."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    with torch.no_grad(), model.trace(ids, **inputs):
        last = model.vision.layers[-1].layer_output.save()
        first = model.layers[0].layer_input.save()
    found = model.positions(ids, **inputs)
    projector = model._module.model.multi_modal_projector
    starts, widths = (0, PATCHES[0]), (8, 6)
    with torch.no_grad():
        normed = projector.norm(last[0])
        for at in (found.image[0] >= 0).nonzero().flatten().tolist():
            image, r, c = (int(t[0, at]) for t in (found.image, found.row, found.col))
            expected = merged_2x2_projection(projector, normed, image, r, c, starts, widths)
            assert torch.allclose(first[0, at], expected, atol=1e-5), at
        specials = found.spans()["special"]
        assert torch.equal(first[0, specials], model._module.model.language_model.embed_tokens(ids[0, specials]))


def test_an_edit_of_the_towers_pattern_moves_the_logits_as_a_hook_on_plain_transformers_predicts(model, prompt):
    """Uniform attention within each image in tower block 0 (its pattern written, block-diagonal): the logits equal
    a run of plain transformers whose block-0 attention mixes the mean of each image's values through o_proj (within
    5e-5), and differ from the unedited logits."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    tower = model._module.model.vision_tower
    edited, expected, plain = pixtral_block_0_uniform_within_each_image(model, tower, PATCHES, ids, **inputs)
    assert torch.allclose(edited, expected, atol=5e-5)  # logits of a few units: 1.2e-5 apart at most
    assert not torch.allclose(expected, plain, atol=1e-3)


def test_support_says_what_the_tower_and_the_language_model_do(model):
    vision = model.vision.support(0)
    assert "block-diagonal" in vision.notes["self_attn.attention_probabilities"]
    assert "2-D rotary" in vision.notes["self_attn.attention_queries"]
    assert "no logits" in vision["logits"] and "projector" in vision["final_norm_output"]
    assert "causally" in model.support(0).notes["self_attn.attention_probabilities"]
