"""LightOnOCR on the transformers engine: a prompt with two images of different sizes, what each position is, the
Pixtral tower's own attention (2-D rotary, block-diagonal over images), against transformers' own attention weights,
hand recomputations of the merger and an edit, and the identities.

The tiny LightOnOCR (`models.tiny("lighton_ocr")`) and its processor (`models.tiny_processor("lighton_ocr")`, built
here): a 2-block Pixtral tower (patches of 4 pixels, 2 heads of 16) whose last hidden state the projector merges
2 x 2, a 3-block Qwen3 language model whose image tokens ([IMG], id 129, one run per image: no break tokens between
rows) attend causally. The prompt's images: 32 x 32 pixels (8 x 8 patches, 4 x 4 tokens) and 16 x 24 (4 x 6 patches,
2 x 3 tokens): the tower's one sequence is 64 + 24 patches.
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

IMAGE = 129
PATCHES = (64, 24)
FIRST = list(range(1, 17))
SECOND = list(range(18, 24))


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("lighton_ocr")


@pytest.fixture(scope="module")
def prompt():
    """The processor's output for text, a 32 x 32 image, text, a 16 x 24 image, text."""
    return processor_prompt("lighton_ocr", "A[IMG]B[IMG]C", (32, 32), (16, 24))


def _inputs(prompt):
    return {"pixel_values": prompt["pixel_values"], "image_sizes": prompt["image_sizes"]}


def test_the_processor_lays_each_image_out_as_one_run_of_image_tokens(prompt):
    """Built locally: the images' sizes kept (multiples of the merged patch, 8 pixels), padded to one batch; 16 [IMG]
    then 6, nothing between the rows."""
    assert prompt["image_sizes"].tolist() == [[32, 32], [16, 24]]
    assert prompt["pixel_values"].shape == (2, 3, 32, 32)
    assert prompt["input_ids"].tolist() == [[36, *[IMAGE] * 16, 37, *[IMAGE] * 6, 38]]


def test_every_pattern_of_both_stacks_equals_transformers_attention_on_a_prompt_with_two_images(model, prompt):
    """The tower's patterns ([1, heads, 88, 88]: both images' patches one sequence) and the language model's (image
    tokens causal, as text) are torch.equal to `output_attentions`; the logits equal the model's."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    (vision, language, logits), own = patterns_beside_output_attentions(
        model, model._module.model.vision_encoder, ids, **inputs
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
    language model (Qwen3's per-head query and key norms), the image tokens causal."""
    saved = read_everything(model, prompt["input_ids"], **_inputs(prompt))
    assert [failures(model.vision, saved["vision"], i) for i in range(2)] == [[], []]
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    assert saved["vision"][(0, "segments")].tolist() == [[0] * 64 + [1] * 24]
    assert saved["vision"]["embeddings"].shape == (1, 88, 32)


def test_a_tower_whose_images_saw_each_other_would_fail(model, prompt):
    """Can fail: held to every patch seeing every patch (no segments: one image), the checks find the zeros between
    the images and the family's unmasked scores."""
    saved = read_everything(model, prompt["input_ids"], **_inputs(prompt))
    for i in range(2):
        del saved["vision"][(i, "segments")]
    found = failures(model.vision, saved["vision"], 0)
    assert "visible entries positive" in found and "scores == family score function" in found


def test_positions_place_every_image_token_on_its_images_merged_grid(model, prompt):
    """Grids from image_sizes over 4 * 2 pixels: 4 x 4 and 2 x 3, row-major, no special tokens; image_sizes missing,
    or a prompt short of an image's tokens, refused naming the field."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    found = model.positions(ids, **inputs)
    assert found.spans() == {"text": [0, 17, 24], "special": [], "image 0": FIRST, "image 1": SECOND}
    assert found.grids == (((4, 4), (2, 3)),)
    assert found.row[0, SECOND].tolist() == [0, 0, 0, 1, 1, 1] and found.col[0, SECOND].tolist() == [0, 1, 2] * 2
    assert found.on_grid(torch.arange(25.0), 1).tolist() == [[18.0, 19.0, 20.0], [21.0, 22.0, 23.0]]
    assert model.positions(prompt).grids == found.grids  # the processor's output as a whole
    with pytest.raises(ValueError, match=r"image_sizes: .* pass the processor's image_sizes"):
        model.positions(ids, pixel_values=inputs["pixel_values"])
    with pytest.raises(ValueError, match="image 1 of prompt 0 has 5 image tokens"):
        model.positions(ids[:, :23], **inputs)


def test_each_image_token_holds_the_merged_projected_feature_of_its_2x2_patches(model, prompt):
    """By hand: the language model's input at the image token of grid (row, col) is the projector (norm, the
    merging layer over the 2 x 2 patches (2 row + i, 2 col + j) of the tower's last block output, channel-major as
    torch's unfold lays them, two linear layers) at that block, within 1e-5: the grid the positions give is the
    model's."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    with torch.no_grad(), model.trace(ids, **inputs):
        last = model.vision.layers[-1].layer_output.save()
        first = model.layers[0].layer_input.save()
    found = model.positions(ids, **inputs)
    projector = model._module.model.vision_projection
    starts, widths = (0, PATCHES[0]), (8, 6)
    with torch.no_grad():
        normed = projector.norm(last[0])
        for at in (found.image[0] >= 0).nonzero().flatten().tolist():
            image, r, c = (int(t[0, at]) for t in (found.image, found.row, found.col))
            expected = merged_2x2_projection(projector, normed, image, r, c, starts, widths)
            assert torch.allclose(first[0, at], expected, atol=1e-5), at


def test_an_edit_of_the_towers_pattern_moves_the_logits_as_a_hook_on_plain_transformers_predicts(model, prompt):
    """Uniform attention within each image in tower block 0 (its pattern written, block-diagonal): the logits equal
    a run of plain transformers whose block-0 attention mixes the mean of each image's values through o_proj (within
    5e-5), and differ from the unedited logits."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    tower = model._module.model.vision_encoder
    edited, expected, plain = pixtral_block_0_uniform_within_each_image(model, tower, PATCHES, ids, **inputs)
    assert torch.allclose(edited, expected, atol=5e-5)
    assert not torch.allclose(expected, plain, atol=1e-3)


def test_support_says_what_the_tower_and_the_language_model_do(model):
    vision = model.vision.support(0)
    assert "block-diagonal" in vision.notes["self_attn.attention_probabilities"]
    assert "2-D rotary" in vision.notes["self_attn.attention_queries"]
    assert "last hidden state" in vision.notes["layer_output"]
    assert "no logits" in vision["logits"] and "projector" in vision["final_norm_output"]
    assert "causally" in model.support(0).notes["self_attn.attention_probabilities"]
