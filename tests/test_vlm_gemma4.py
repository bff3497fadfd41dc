"""Gemma 4 with images on the transformers engine: its vision tower (`model.vision`: 2-D rotary positions, padding
patches masked as keys) and its language model (an image's tokens see each other both ways on the sliding layers,
within the window looking back; its full-attention layers stay causal), against transformers' own attention weights,
the identities and hand recomputations.

The tiny model (`models.tiny("gemma4")`): a 2-block tower 32 wide (patches of 4 pixels, pooled 2 x 2), a 3-block
language model (sliding, full, full; window 4) with `use_bidirectional_attention='vision'`. Its processor
(`models.tiny_processor("gemma4")`) resizes a 24 x 40 picture to 48 x 80 (12 x 20 patches: 6 x 10 image tokens) and a
40 x 40 one to 64 x 64 (16 x 16 patches: 8 x 8 tokens), each padded to 280 patches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from images import served_patterns
from PIL import Image

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.parts.multimodal import LanguageModelOf

PROMPT = "ab<|image|>c<|image|>de"
FIRST, SECOND = list(range(3, 63)), list(range(66, 130))  # image 0's 60 tokens, image 1's 64
SLIDING, FULL = 0, 1


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("gemma4")


@pytest.fixture(scope="module")
def inputs():
    """The processor's output for a prompt with two images of different shapes: input_ids, mm_token_type_ids,
    pixel_values [2, 280, 48], image_position_ids [2, 280, 2]."""
    processor = attnlens.models.tiny_processor("gemma4")
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((24, 40), (40, 40))]
    found = dict(processor(text=[PROMPT], images=[pictures], return_tensors="pt"))
    del found["attention_mask"]
    return found


def _split(inputs):
    rest = dict(inputs)
    return rest.pop("input_ids"), rest


def test_every_pattern_of_both_stacks_equals_transformers_attention_on_a_prompt_with_two_images(model, inputs):
    """The tower's patterns (one per image, padding patches masked as keys) and the language model's (image rows
    both ways on the sliding layer, causal on the full ones) are torch.equal to `output_attentions`; so are the
    logits."""
    ids, rest = _split(inputs)
    with torch.no_grad():
        own = model._module(input_ids=ids, output_attentions=True, **rest)
        tower = model._module.model.vision_tower(
            rest["pixel_values"], rest["image_position_ids"], output_attentions=True
        )
    vision, language, logits = served_patterns(model, ids, **rest)
    assert len(vision) == len(tower.attentions) == 2 and len(language) == len(own.attentions) == 3
    assert all(torch.equal(found, expected) for found, expected in zip(vision, tower.attentions))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    assert vision[0].shape == (2, 2, 280, 280)  # two images, two heads, the budget's 280 patches each way
    assert (vision[0][0, :, :, 240:] == 0).all() and (vision[0][0, :, :, :240] > 0).all()  # image 0: 40 padding
    assert (vision[0][1, :, :, 256:] == 0).all() and (vision[0][1, :, :, :256] > 0).all()  # image 1: 24 padding
    sliding, full = language[SLIDING][0], language[FULL][0]
    row = FIRST[10]
    assert (sliding[:, row, FIRST[11:]] > 0).all()  # every later token of its image
    assert (sliding[:, row, FIRST[7:10]] > 0).all() and (sliding[:, row, FIRST[:7]] == 0).all()  # 3 back: window 4
    assert (sliding[:, row, SECOND] == 0).all()  # not a later image
    assert (full[:, row, row + 1 :] == 0).all()  # a full-attention layer is causal over the image too


def test_the_identities_hold_on_both_stacks_with_images(model, inputs):
    """Every identity of every block of the tower and of the language model: the masked entries are the model's
    (padding patches' keys; an image's tokens on the sliding layer), the scores the families' score functions'."""
    ids, rest = _split(inputs)
    saved = read_everything(model, ids, **rest)
    assert [failures(model.vision, saved["vision"], i) for i in range(model.vision.num_layers)] == [[], []]
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]


def test_the_masks_would_be_wrong_without_the_image_spans_or_the_padding(model, inputs, monkeypatch):
    """Can fail: without the image positions the checks hold the sliding layer's image rows to the causal mask; with
    Gemma 3's overlay (an image both ways on every layer, no window) the full layer's; without the padding the
    tower's rows to every patch. Each fails."""
    ids, rest = _split(inputs)
    saved = read_everything(model, ids, **rest)
    without = {key: value for key, value in saved.items() if key != "image_of"}
    assert "masked entries exactly zero" in failures(model, without, SLIDING)
    assert failures(model, without, FULL) == []  # causal there: the image positions change nothing

    with monkeypatch.context() as patched:  # Gemma 3's overlay (LanguageModelOf's): every layer, no window
        patched.setattr(model.family.ScoreFunction, "mask", LanguageModelOf.ScoreFunction.mask)
        assert "visible entries positive" in failures(model, saved, FULL)
        assert "visible entries positive" in failures(model, saved, SLIDING)  # beyond the window looking back
    tower = {key: value for key, value in saved["vision"].items() if key[1:] != ("segments",)}
    assert {"visible entries positive", "scores == family score function"} <= set(failures(model.vision, tower, 0))


def test_without_bidirectional_vision_every_layer_is_causal_and_the_score_function_follows(model, inputs):
    """`use_bidirectional_attention=None` (the smaller checkpoints): the model attends causally over images, and the
    score function, given the image positions, says so; the note says which."""
    ids, rest = _split(inputs)
    text = model._module.config.text_config
    assert model.config.get_text_config() is text
    text.use_bidirectional_attention = None
    try:
        saved = read_everything(model, ids, layers=[SLIDING], **rest)
        assert "image_of" in saved and failures(model, saved, SLIDING) == []
        assert (saved[(SLIDING, "attention_probabilities")][0, :, FIRST[0], FIRST[1]] == 0).all()
        assert "attend causally" in model.support(SLIDING).notes["self_attn.attention_probabilities"]
    finally:
        text.use_bidirectional_attention = "vision"
    assert "both ways within the window" in model.support(SLIDING).notes["self_attn.attention_probabilities"]
    assert "full-attention layer" in model.support(FULL).notes["self_attn.attention_probabilities"]


def test_the_sdpa_rebuild_masks_an_image_as_the_model_does(inputs):
    """On sdpa with `rebuild_patterns`, the language model's patterns rebuilt from the queries and keys with the
    family's mask equal the eager ones within 1e-5 (the image rows too: both ways on the sliding layer); the tower's
    pattern is read in the eager function only, and refused with the reason."""
    ids, rest = _split(inputs)
    eager = attnlens.models.tiny("gemma4")
    sdpa = attnlens.models.tiny("gemma4", attn_implementation="sdpa", rebuild_patterns=True)

    def patterns(model):
        with torch.no_grad(), model.trace(ids, **rest):
            sliding = model.layers[SLIDING].self_attn.attention_probabilities.save()
            full = model.layers[FULL].self_attn.attention_probabilities.save()
        return sliding, full

    for found, expected in zip(patterns(sdpa), patterns(eager)):
        assert torch.allclose(found, expected, atol=1e-5)
    assert "attn_implementation='eager'" in sdpa.vision.support(0)["self_attn.attention_probabilities"]


def test_positions_place_every_image_token_on_its_images_own_grid(model, inputs):
    """Each image's grid is its own (6 x 10, 8 x 8), read off image_position_ids; the image tokens are placed
    row-major between the begin and end tokens; without image_position_ids or mm_token_type_ids a clear error."""
    ids, rest = _split(inputs)
    found = model.positions(ids, **rest)
    assert found.grids == (((6, 10), (8, 8)),)
    spans = {"text": [0, 1, 64, 131, 132], "special": [2, 63, 65, 130], "image 0": FIRST, "image 1": SECOND}
    assert found.spans() == spans
    assert found.row[0, FIRST[10:12]].tolist() == [1, 1] and found.col[0, FIRST[10:12]].tolist() == [0, 1]
    assert found.on_grid(torch.arange(ids.shape[1]), 1)[7].tolist() == SECOND[56:]
    with pytest.raises(ValueError, match="image_position_ids: Gemma 4's images have grids of their own"):
        model.positions(ids)
    with pytest.raises(ValueError, match="mm_token_type_ids: with use_bidirectional_attention='vision'"):
        model.positions(ids, pixel_values=rest["pixel_values"], image_position_ids=rest["image_position_ids"])


def test_each_image_token_holds_its_pooled_patches_projected(model, inputs):
    """By hand: the language model's input at image i's token (row r, column c) is embed_vision of sqrt(hidden) times
    the mean of the tower's last block's output over the 2 x 2 patches at columns 2c, 2c+1 and rows 2r, 2r+1."""
    ids, rest = _split(inputs)
    with torch.no_grad(), model.trace(ids, **rest):
        last = model.vision.layers[-1].layer_output.save()
        first = model.layers[0].layer_input.save()
    found = model.positions(ids, **rest)
    where = rest["image_position_ids"]
    embed = model._module.model.embed_vision
    width = model.config.vision_config.hidden_size
    checked = 0
    with torch.no_grad():
        for at in (found.image[0] >= 0).nonzero().flatten().tolist():
            image, r, c = (int(t[0, at]) for t in (found.image, found.row, found.col))
            x, y = where[image, :, 0], where[image, :, 1]
            square = (x // 2 == c) & (y // 2 == r) & (x >= 0)
            assert int(square.sum()) == 4
            pooled = last[image, square].mean(0) * width**0.5
            assert torch.allclose(first[0, at], embed(pooled[None])[0], atol=1e-5), at
            checked += 1
    assert checked == len(FIRST) + len(SECOND)


def test_an_edit_of_the_towers_pattern_moves_the_logits_as_recomputing_by_hand_predicts(model, inputs):
    """Uniform attention over each image's real patches in the tower's last block: the logits equal a hand-run of the
    model whose last tower block mixes, for every patch, the mean of the real patches' values (v_norm(v_proj(x)),
    each key/value head serving its query heads) through o_proj; and they move."""
    ids, rest = _split(inputs)
    real = (rest["image_position_ids"] != -1).all(-1).float()  # [images, patches]
    uniform = (real / real.sum(-1, keepdim=True))[:, None, None, :]
    last = model.vision.layers[-1]
    with torch.no_grad(), model.trace(ids, **rest):
        pattern = last.self_attn.attention_probabilities
        last.self_attn.attention_probabilities = uniform.expand_as(pattern).clone()
        edited = model.logits.save()
    module = model._module.model.vision_tower.encoder.layers[-1].self_attn

    def mixed(hidden_states, *args, **kwargs):
        b, n, _ = hidden_states.shape
        values = module.v_norm(module.v_proj(hidden_states).view(b, n, -1, module.head_dim))
        mean = (values * real[:, :, None, None]).sum(1, keepdim=True) / real.sum(1)[:, None, None, None]
        heads = mean.repeat_interleave(module.num_key_value_groups, dim=2).expand(b, n, -1, -1)
        return module.o_proj(heads.reshape(b, n, -1)), None

    original = module.forward
    module.forward = mixed
    try:
        with torch.no_grad():
            expected = model._module(input_ids=ids, **rest).logits
    finally:
        module.forward = original
    with torch.no_grad():
        plain = model._module(input_ids=ids, **rest).logits
    assert torch.allclose(edited, expected, atol=1e-5)
    assert not torch.allclose(edited, plain, atol=1e-3)
    support = model.vision.support(0)
    assert support["self_attn.attention_probabilities"] is None
    assert "no logits" in support["logits"] and "no final norm" in support["final_norm_output"]


def test_the_audio_tower_is_refused_with_its_reason():
    """Gemma 4's audio tower is not mounted: the family says why, and the coverage repeats it."""
    from transformers import AutoConfig

    from attnlens.vision_types import coverage

    said = coverage(AutoConfig.for_model("gemma4"))
    assert said.outcome == "images" and "tower model.vision served (Gemma4VisionTower" in said.detail
    assert "tower model.audio refused: Gemma 4's audio tower" in said.detail


def test_attnlens_show_with_an_image_puts_gemma4s_image_token_in_the_prompt(tmp_path):
    """Gemma 4's processor expands its image token (Gemma 3's expands the image's start): `attnlens show --image`
    finds the placeholder the processor takes, and the page places the image's tokens on their grid."""
    import cli_run
    from PIL import Image
    from test_show import page_data

    picture = tmp_path / "picture.png"
    Image.fromarray((torch.rand(24, 40, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy()).save(
        picture
    )
    page = tmp_path / "page.html"
    run = cli_run.attnlens(
        "show", "tiny:gemma4", "Describe this.", "--image", str(picture), "--layer", "all", "--out", str(page)
    )
    assert run.returncode == 0, run.stderr
    data = page_data(page.read_text())
    assert len(data["images"]) == 1 and data["images"][0]["rows"] * data["images"][0]["cols"] > 1
