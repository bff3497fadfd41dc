"""Idefics3 and SmolVLM with an image split into tiles: the tower (SigLIP-like, each tile and the global view one
image of its batch) and the Llama language model, each pattern equal to transformers' `output_attentions`, the
identities, the positions of each view's pixel-shuffled tokens, and an edit moving the logits as a hand-run predicts.
Idefics2 the same with its crops padded (the tower's padding patches masked), positions refused (resampler latents)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from images import logits_with_uniform_tower_attention, served_patterns
from PIL import Image

import attnlens
from attnlens.checks import failures, read_everything

TYPES = ["idefics3", "smolvlm"]


def _served(model_type):
    """The tiny model of `model_type`, the ids and the other inputs its tiny processor makes of "ab<image>cd" with
    one 100 x 120 image (no attention mask)."""
    model = attnlens.models.tiny(model_type)
    processor = attnlens.models.tiny_processor(model_type)
    image = Image.fromarray(np.random.RandomState(0).randint(0, 255, (100, 120, 3), dtype=np.uint8))
    inputs = dict(processor(text=["ab<image>cd"], images=[[image]], return_tensors="pt"))
    del inputs["attention_mask"]
    return model, inputs.pop("input_ids"), inputs


@pytest.fixture(scope="module", params=TYPES)
def served(request):
    """The tiny model and the processor's inputs for "ab<image>cd" with one 100 x 120 image: 2 x 2 tiles of 64, then
    the global view, each 2 x 2 image tokens (4 x 4 patches shuffled 2 x 2)."""
    return _served(request.param)


def _unedited_edited_and_hand_run_logits(model, ids, inputs):
    """The model's logits; its logits with tower block 0's pattern uniform (written); and the model run by hand with
    that block attending uniformly (`logits_with_uniform_tower_attention`, the tower at `vision_model`)."""
    with torch.no_grad():
        plain = model._module(input_ids=ids, **inputs).logits
    with torch.no_grad(), model.trace(ids, **inputs):
        pattern = model.vision.layers[0].self_attn.attention_probabilities
        model.vision.layers[0].self_attn.attention_probabilities = torch.full_like(pattern, 1 / pattern.shape[-1])
        logits = model.logits.save()
    module = model._module.model
    module.vision_tower = module.vision_model  # where the hand-run finds the tower
    try:
        expected = logits_with_uniform_tower_attention(model, 0, ids, **inputs)
    finally:
        del module.vision_tower
    return plain, logits, expected


def test_every_pattern_of_both_stacks_equals_transformers_attention(served):
    """The tower's patterns (5 views, 16 patches each) and the language model's torch.equal `output_attentions`."""
    model, ids, inputs = served
    assert inputs["pixel_values"].shape == (1, 5, 3, 64, 64) and bool(inputs["pixel_attention_mask"].all())
    with torch.no_grad():
        own = model._module(input_ids=ids, output_attentions=True, **inputs)
        tower = model._module.model.vision_model(inputs["pixel_values"][0], output_attentions=True)
    vision, language, logits = served_patterns(model, ids, **inputs)
    assert len(vision) == len(tower.attentions) == 2 and len(language) == len(own.attentions) == 3
    assert all(torch.equal(found, expected) for found, expected in zip(vision, tower.attentions))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    assert vision[0].shape == (5, 2, 16, 16) and (vision[1] > 0).all()
    first = language[0][0][:, 4:8, 4:8]
    seen = torch.ones(4, 4, dtype=torch.bool).tril()
    assert (first[:, ~seen] == 0).all() and (first[:, seen] > 0).all()  # a view's tokens: causal, as text


def test_the_identities_hold_on_both_stacks(served):
    model, ids, inputs = served
    saved = read_everything(model, ids, **inputs)
    assert [failures(model.vision, saved["vision"], i) for i in range(2)] == [[], []]
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    assert saved["vision"]["embeddings"].shape == (5, 16, 32)


def test_positions_place_each_tile_and_the_global_view(served):
    """Four tiles (2 x 2, row by row) then the global view, each a 2 x 2 grid; the tags special, newlines text."""
    model, ids, inputs = served
    found = model.positions(ids, **inputs)
    assert found.views == ((((2, 2),) * 5,),)
    starts = [4, 10, 17, 23, 31]
    assert [found.of_image(0, view=v).tolist() for v in range(5)] == [list(range(s, s + 4)) for s in starts]
    assert found.spans()["special"] == [2, 3, 8, 9, 15, 16, 21, 22, 29, 30, 35]
    assert found.spans()["text"] == [0, 1, 14, 27, 28, 36, 37]
    with pytest.raises(ValueError, match="not runs of 2 x 2"):
        model.positions(ids[:, :33])


def test_changing_one_tiles_pixels_moves_the_embeddings_exactly_at_its_view(served):
    """The second tile's pixels changed: `model.embeddings` (what the first block reads) moves at that view's four
    tokens and nowhere else."""
    model, ids, inputs = served
    changed = {**inputs, "pixel_values": inputs["pixel_values"].clone()}
    changed["pixel_values"][0, 1] += 1.0
    read = []
    for given in (inputs, changed):
        with torch.no_grad(), model.trace(ids, **given):
            read.append(model.embeddings.save())
    moved = (read[0] != read[1]).any(-1)[0].nonzero().flatten().tolist()
    assert moved == model.positions(ids, **inputs).of_image(0, view=1).tolist() == [10, 11, 12, 13]


def test_an_edit_of_the_towers_attention_moves_the_logits_as_a_hand_run_predicts(served):
    """Uniform attention in tower block 0: the logits equal the model run with that block attending uniformly."""
    model, ids, inputs = served
    plain, logits, expected = _unedited_edited_and_hand_run_logits(model, ids, inputs)
    assert not torch.allclose(expected, plain, atol=1e-3)
    assert torch.allclose(logits, expected, atol=1e-5)


def test_padding_patches_are_masked_as_keys_in_the_tower_as_the_model_masks_them(served):
    """A view whose right half is padding (`pixel_attention_mask` zero there, as for an image smaller than the batch's
    largest): the tower's patterns torch.equal the model's, no patch attends to a padding patch, and the identities
    hold with the score function masking those keys (`segments`). Can fail: without the segments the checks find the
    padding keys' zero probabilities and their masked scores against the unmasked score function."""
    model, ids, inputs = served
    padded = {"pixel_values": inputs["pixel_values"].clone(), "pixel_attention_mask": inputs["pixel_attention_mask"]}
    padded["pixel_attention_mask"] = padded["pixel_attention_mask"].clone()
    padded["pixel_attention_mask"][0, 4, :, 32:] = 0
    padded["pixel_values"][0, 4, :, :, 32:] = 0.0
    with torch.no_grad():
        tower = model._module.model.get_image_features(**padded, output_attentions=True)
    saved = read_everything(model, ids, **padded)
    vision = saved["vision"]
    assert all(torch.equal(vision[(i, "attention_probabilities")], tower.attentions[i]) for i in range(2))
    padding = torch.arange(16) % 4 >= 2  # the two right columns of the 4 x 4 patch grid
    assert (vision[(0, "attention_probabilities")][4][..., padding] == 0).all()
    assert (vision[(0, "attention_probabilities")][3][..., padding] > 0).all()  # a full view's are seen
    assert [failures(model.vision, vision, i) for i in range(2)] == [[], []]
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    unmasked = {key: value for key, value in vision.items() if key[-1] != "segments"}
    assert "scores == family score function" in failures(model.vision, unmasked, 0)


def test_a_mask_that_let_a_views_tokens_see_each_other_both_ways_would_fail(served, monkeypatch):
    """Can fail: were a view's image tokens said to see each other both ways, the checks would find the entries above
    the diagonal of its rows zero where that mask makes them visible."""
    from attnlens.families.idefics import IdeficsImages

    class BothWays(IdeficsImages):
        bidirectional = True

    model, ids, inputs = served
    saved = read_everything(model, ids, **inputs)
    monkeypatch.setattr(model.family, "images", BothWays())
    assert "visible entries positive" in failures(model, saved, 0)


@pytest.fixture(scope="module")
def idefics2():
    """The tiny Idefics2 and the processor's inputs for "ab<image>cd" with one 100 x 120 image: four crops and the
    whole image, each 53 x 64 pixels padded to the batch's 64 x 64 views, each 4 latent image tokens."""
    return _served("idefics2")


def test_idefics2_patterns_of_both_stacks_equal_transformers_attention_and_the_identities_hold(idefics2):
    """The tower's patterns (5 views of 3 x 4 patches, the crops' last column padding, masked as keys) and the Mistral
    language model's (its window of 4 crossing the image tokens) torch.equal the model's; every identity of both
    stacks holds."""
    model, ids, inputs = idefics2
    with torch.no_grad():
        own = model._module(input_ids=ids, output_attentions=True, **inputs)
        tower = model._module.model.get_image_features(**inputs, output_attentions=True)
    saved = read_everything(model, ids, **inputs)
    vision = saved["vision"]
    assert all(torch.equal(vision[(i, "attention_probabilities")], tower.attentions[i]) for i in range(2))
    assert all(torch.equal(saved[(i, "attention_probabilities")], own.attentions[i]) for i in range(3))
    assert torch.equal(saved["logits"], own.logits)
    assert (saved[(0, "attention_probabilities")][0] > 0).sum(-1).max() == 4  # Mistral's window, over image tokens
    padding = vision[(0, "segments")] < 0
    assert padding[:4, 3::4].all() and int(padding.sum()) == 12  # a crop's patches of partly padded pixels
    assert (vision[(0, "attention_probabilities")][:4][..., 3::4] == 0).all()
    assert [failures(model.vision, vision, i) for i in range(2)] == [[], []]
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    unmasked = {key: value for key, value in vision.items() if key[-1] != "segments"}
    assert "scores == family score function" in failures(model.vision, unmasked, 0)


def test_idefics2_an_edit_of_the_towers_attention_moves_the_logits_as_a_hand_run_predicts(idefics2):
    """Uniform attention (over every key, padding included) in tower block 0: the logits equal the model run with that
    block attending uniformly, through the resampler."""
    model, ids, inputs = idefics2
    plain, logits, expected = _unedited_edited_and_hand_run_logits(model, ids, inputs)
    assert not torch.allclose(expected, plain, atol=1e-3)
    assert torch.allclose(logits, expected, atol=1e-5)


def test_idefics2_positions_and_the_resampler_are_refused_with_the_reason(idefics2):
    """The image tokens are the resampler's latents (no place on a grid): `model.positions` refuses them; the
    resampler is named as a tower not mounted; the language model's window is the text config's."""
    from attnlens.vision_types import coverage

    model, ids, inputs = idefics2
    with pytest.raises(attnlens.errors.Unavailable, match="perceiver resampler's resampler_n_latents"):
        model.positions(ids, **inputs)
    said = coverage(model.config).detail
    assert "tower model.resampler refused" in said and "image positions refused" in said
