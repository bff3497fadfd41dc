"""Gemma 4 Unified with images on the transformers engine: no vision tower (its embedder has no attention), each
merged patch one image token, an image's tokens seeing each other both ways on every layer (past the sliding window)
with `use_bidirectional_attention='vision'`; against transformers' own attention weights, the identities and a hand
recomputation.

The tiny model (`models.tiny("gemma4_unified")`): a 3-block language model (sliding, full, full; window 4) and an
embedder of merged patches of 2 x 2 patches of 2 pixels (48 channels). transformers' image processor for the type is
torchvision's (not installed here), so the inputs are built by hand as the processor lays them out: each image's merged
patches row-major, `image_position_ids` their (column, row), padded with (-1, -1) to 20 places.
"""

from __future__ import annotations

import pytest
import torch

import attnlens
from attnlens.checks import failures, read_everything

IMAGE, START, END = 129, 130, 131
GRIDS = [(3, 5), (4, 4)]  # (rows, columns) of merged patches: 15 and 16 image tokens
PLACES = 20
PROMPT = torch.tensor(
    [[1, 40, 41, START, *[IMAGE] * 15, END, 42, START, *[IMAGE] * 16, END, 42, 43]]
)  # fmt: skip
FIRST, SECOND = list(range(4, 19)), list(range(22, 38))
SLIDING, FULL = 0, 1


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("gemma4_unified")


@pytest.fixture(scope="module")
def inputs():
    pixels = torch.rand(len(GRIDS), PLACES, 48, generator=torch.Generator().manual_seed(0))
    where = torch.full((len(GRIDS), PLACES, 2), -1)
    for image, (rows, cols) in enumerate(GRIDS):
        y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        where[image, : rows * cols] = torch.stack([x.flatten(), y.flatten()], -1)
    return {"pixel_values": pixels, "image_position_ids": where, "mm_token_type_ids": (PROMPT == IMAGE).long()}


def test_every_pattern_equals_transformers_attention_on_a_prompt_with_two_images(model, inputs):
    """Each block's pattern torch.equal to `output_attentions`, the logits too; an image's row sees its whole image on
    the sliding layer (past the window) and on the full ones, never the other image; `embeddings` is what the first
    block reads (the merged patches in the image rows)."""
    with torch.no_grad():
        own = model._module(input_ids=PROMPT, output_attentions=True, **inputs)
    language = []
    with torch.no_grad(), model.trace(PROMPT, **inputs):
        embeddings = model.embeddings.save()
        first = model.layers[0].layer_input.save()
        for i in range(3):
            language.append(model.layers[i].self_attn.attention_probabilities.save())
        logits = model.logits.save()
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits) and torch.equal(embeddings, first)
    for layer in (SLIDING, FULL):
        assert (language[layer][0, :, FIRST[0]][..., FIRST] > 0).all()  # 14 tokens later: past the window of 4
        assert (language[layer][0, :, FIRST[-1]][..., FIRST] > 0).all()  # and 14 back
        assert (language[layer][0, :, FIRST[0]][..., SECOND] == 0).all()


def test_the_identities_hold_and_would_fail_with_a_wrong_image_mask(model, inputs, monkeypatch):
    """Every identity of every block holds with the image positions; without them (image rows held causal), or with
    Gemma 4's mask (an image both ways on sliding layers only, within the window looking back), they fail."""
    saved = read_everything(model, PROMPT, **inputs)
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]
    causal = {key: value for key, value in saved.items() if key != "image_of"}
    assert all("masked entries exactly zero" in failures(model, causal, i) for i in range(model.num_layers))
    monkeypatch.setattr(model.family.ScoreFunction, "mask", attnlens.registered()["gemma4"].ScoreFunction.mask)
    assert "masked entries exactly zero" in failures(model, saved, SLIDING)
    assert "masked entries exactly zero" in failures(model, saved, FULL)


def test_without_bidirectional_vision_every_layer_is_causal_and_the_score_function_follows(model, inputs):
    text = model._module.config.text_config
    text.use_bidirectional_attention = None
    try:
        saved = read_everything(model, PROMPT, **inputs)
        assert "image_of" in saved and [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]
        assert (saved[(FULL, "attention_probabilities")][0, :, FIRST[0], FIRST[1]] == 0).all()
        assert "attend causally" in model.support(FULL).notes["self_attn.attention_probabilities"]
    finally:
        text.use_bidirectional_attention = "vision"
    assert "both ways" in model.support(FULL).notes["self_attn.attention_probabilities"]


def test_positions_place_each_merged_patch_and_its_token_holds_it_embedded(model, inputs):
    """The grids are read off image_position_ids (3 x 5, 4 x 4); by hand, the first block's input at image i's token
    (row r, column c) is embed_vision's output for that image's merged patch at (c, r)."""
    found = model.positions(PROMPT, **inputs)
    assert found.grids == ((GRIDS[0], GRIDS[1]),)
    assert found.spans() == {
        "text": [0, 1, 2, 20, 39, 40],
        "special": [3, 19, 21, 38],
        "image 0": FIRST,
        "image 1": SECOND,
    }
    with torch.no_grad(), model.trace(PROMPT, **inputs):
        first = model.layers[0].layer_input.save()
    with torch.no_grad():
        embedded = model._module.model.embed_vision(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output
    for at in FIRST + SECOND:
        image, r, c = (int(t[0, at]) for t in (found.image, found.row, found.col))
        place = int(((inputs["image_position_ids"][image] == torch.tensor([c, r])).all(-1)).nonzero())
        assert torch.allclose(first[0, at], embedded[image, place], atol=1e-6), at
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        model.positions(PROMPT, pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"])
    assert model.family.images.tiny_processor(model.config, None) is None  # torchvision's processor only


def test_zeroing_the_second_images_keys_moves_the_logits_as_a_hook_on_plain_transformers_predicts(model, inputs):
    """The keys of image 1's tokens in the full layer set to zero: the logits equal the plain model's with a hook
    zeroing k_norm's output there (the keys before the rotary, which keeps zero at zero), and they move."""
    with torch.no_grad(), model.trace(PROMPT, **inputs):
        keys = model.layers[FULL].self_attn.attention_keys
        keys[:, :, SECOND] = 0
        edited = model.logits.save()
    norm = model._module.model.language_model.layers[FULL].self_attn.k_norm

    def zero(module, args, output):
        output = output.clone()
        output[:, SECOND] = 0
        return output

    handle = norm.register_forward_hook(zero)
    try:
        with torch.no_grad():
            expected = model._module(input_ids=PROMPT, **inputs).logits
    finally:
        handle.remove()
    with torch.no_grad():
        plain = model._module(input_ids=PROMPT, **inputs).logits
    assert torch.allclose(edited, expected, atol=1e-5)
    assert not torch.allclose(edited, plain, atol=1e-3)


def test_the_coverage_says_served_with_images_and_no_tower():
    from transformers import AutoConfig

    from attnlens.vision_types import coverage

    said = coverage(AutoConfig.for_model("gemma4_unified"))
    assert said.outcome == "images" and "no tower mounted" in said.detail and "merged patch" in said.detail
