"""InternVL on the transformers engine: a prompt with two images, one a single tile and one cut into two crops and a
thumbnail, what each position is (each tile a view), the InternViT tower's own attention (a class token, norms over
all heads' queries and keys, layer scale), against transformers' own attention weights, hand recomputations of the
query norm, the pixel shuffle and an edit, and the identities.

The tiny InternVL (`models.tiny("internvl")`) and its processor (`models.tiny_processor("internvl")`, built here): a
2-block InternViT tower (tiles of 16 x 16 pixels in 4 x 4 patches, 2 heads of 16, qk-norm on, layer scale 0.5) whose
last hidden state, the class token dropped, is pixel-shuffled 2 x 2 (2 x 2 tokens a tile) and projected, a 3-block
Qwen2 language model whose image tokens ([IMG_CONTEXT], id 129, between <img> 130 and </img> 131) attend causally.
The prompt's images: 16 x 16 pixels (one tile) and 16 x 32 (two crops and a thumbnail): 4 tiles, 4 + 12 tokens.
"""

from __future__ import annotations

import pytest
import torch
from images import patterns_beside_output_attentions, processor_prompt

import attnlens
from attnlens.checks import failures, read_everything

IMAGE, START, END = 129, 130, 131
FIRST = [2, 3, 4, 5]
SECOND = list(range(9, 21))
TILES = 4


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("internvl")


@pytest.fixture(scope="module")
def prompt():
    """The processor's output for text, a 16 x 16 image, text, a 16 x 32 image, text."""
    return processor_prompt("internvl", "A<IMG_CONTEXT>B<IMG_CONTEXT>C", (16, 16), (16, 32))


def _inputs(prompt):
    return {"pixel_values": prompt["pixel_values"]}


def test_the_processor_puts_each_images_tiles_between_img_and_end_img(prompt):
    """Built locally: one tile for the square image, two crops and a thumbnail for the wide one (4 pixel_values rows);
    4 [IMG_CONTEXT] a tile."""
    assert prompt["pixel_values"].shape == (TILES, 3, 16, 16)
    assert prompt["input_ids"].tolist() == [[36, START, *[IMAGE] * 4, END, 37, START, *[IMAGE] * 12, END, 38]]


def test_every_pattern_of_both_stacks_equals_transformers_attention_on_a_prompt_with_two_images(model, prompt):
    """The tower's patterns ([tiles, heads, 17, 17]: the class token and 16 patches of each tile) and the language
    model's (image tokens causal, as text) are torch.equal to `output_attentions`; the logits equal the model's."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    (vision, language, logits), own = patterns_beside_output_attentions(
        model, model._module.model.vision_tower, ids, **inputs
    )
    assert len(vision) == len(own.vision) == 2 and len(language) == len(own.language) == 3
    assert all(torch.equal(found, expected) for found, expected in zip(vision, own.vision))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.language))
    assert torch.equal(logits, own.logits)
    assert vision[0].shape == (TILES, 2, 17, 17) and (vision[0] > 0).all()  # every position of a tile sees all
    second = language[1][0][:, SECOND][..., SECOND]
    seen = torch.ones(12, 12, dtype=torch.bool).tril()
    assert (second[:, ~seen] == 0).all() and (second[:, seen] > 0).all()  # an image's tokens: causal, as text


def test_the_identities_hold_on_both_stacks_with_images(model, prompt):
    saved = read_everything(model, prompt["input_ids"], **_inputs(prompt))
    assert [failures(model.vision, saved["vision"], i) for i in range(2)] == [[], []]
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    assert saved["vision"]["embeddings"].shape == (TILES, 17, 32)


def test_a_tower_without_its_layer_scale_would_fail(model, prompt, monkeypatch):
    """Can fail: held to a plain residual add (no lambda_1, lambda_2), the identities find both residual adds wrong."""
    from attnlens.families.internvl import InternViTTower
    from attnlens.parts import identities

    saved = read_everything(model, prompt["input_ids"], **_inputs(prompt))
    monkeypatch.setattr(InternViTTower.Identities, "residual_add", identities.Identities.residual_add)
    found = failures(model.vision, saved["vision"], 0)
    assert "layer mid + mlp output == layer output" in found
    assert any(name.startswith("layer input + attention output") for name in found), found


def test_queries_and_keys_are_normed_over_all_heads_before_the_split(model, prompt):
    """By hand: block 0's queries are q_norm(q_proj(layernorm_before(layer_input))) split into 2 heads of 16, within
    1e-6; normed per head instead (the RMS over each head's 16 channels) they differ."""
    with torch.no_grad(), model.trace(prompt["input_ids"], **_inputs(prompt)):
        normed = model.vision.layers[0].attention_norm_output.save()
        queries = model.vision.layers[0].self_attn.attention_queries.save()
    module = model._module.model.vision_tower.encoder.layer[0].attention
    with torch.no_grad():
        projected = module.q_proj(normed)
        expected = module.q_norm(projected).view(TILES, 17, 2, 16).transpose(1, 2)
        heads = projected.view(TILES, 17, 2, 16)
        per_head = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * module.q_norm.weight.view(2, 16)
    assert torch.allclose(queries, expected, atol=1e-6)
    assert not torch.allclose(queries, per_head.transpose(1, 2), atol=1e-3)


def test_positions_make_each_tile_a_view_of_its_image(model, prompt):
    """Each image's tokens between its <img> and </img> (special), each tile one 2 x 2 view: the wide image three
    views (two crops, the thumbnail last); a run short of a tile, or pixel_values of another count of tiles, refused
    naming the field."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    found = model.positions(ids, **inputs)
    assert found.spans() == {"text": [0, 7, 22], "special": [1, 6, 8, 21], "image 0": FIRST, "image 1": SECOND}
    assert found.views == ((((2, 2),), ((2, 2),) * 3),) and found.grids == (((2, 2), (2, 2)),)
    assert found.view[0, SECOND].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert found.row[0, SECOND].tolist() == [0, 0, 1, 1] * 3 and found.col[0, SECOND].tolist() == [0, 1] * 6
    assert found.on_grid(torch.arange(23.0), 1, view=2).tolist() == [[17.0, 18.0], [19.0, 20.0]]
    assert model.positions(prompt).views == found.views  # the processor's output as a whole
    short = torch.cat([ids[:, :20], ids[:, 21:]], 1)
    with pytest.raises(ValueError, match=r"image 1 of prompt 0 has 11 image tokens .* each tile needs 4"):
        model.positions(short, **inputs)
    with pytest.raises(ValueError, match=r"pixel_values: 3 tiles where input_ids hold 4"):
        model.positions(ids, pixel_values=inputs["pixel_values"][:3])


def test_each_image_token_holds_the_pixel_shuffled_projected_feature_of_its_2x2_patches(model, prompt):
    """By hand: the language model's input at the token of view (tile) v, grid (row, col) is the projector over the
    patches (2 row + i, 2 col + j) of that tile in the tower's final output (the class token's row dropped), i major,
    within 1e-5: the tiles and grids `positions` gives are the model's."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    with torch.no_grad(), model.trace(ids, **inputs):
        last = model.vision.final_norm_output.save()
        first = model.layers[0].layer_input.save()
    found = model.positions(ids, **inputs)
    projector = model._module.model.multi_modal_projector
    patches = last[:, 1:].view(TILES, 4, 4, 32)
    starts = (0, 1)  # the pixel_values row of each image's first tile
    with torch.no_grad():
        for at in (found.image[0] >= 0).nonzero().flatten().tolist():
            image, v, r, c = (int(t[0, at]) for t in (found.image, found.view, found.row, found.col))
            tile = patches[starts[image] + v]
            merged = torch.cat([tile[2 * r + i, 2 * c + j] for i in range(2) for j in range(2)])
            expected = projector.linear_2(projector.act(projector.linear_1(projector.layer_norm(merged))))
            assert torch.allclose(first[0, at], expected, atol=1e-5), at


def test_an_edit_of_the_towers_pattern_moves_the_logits_as_a_hook_on_plain_transformers_predicts(model, prompt):
    """Uniform attention over each tile in tower block 0 (its pattern written): the logits equal a run of plain
    transformers whose block-0 attention mixes the mean of each tile's values through projection_layer (within 5e-5),
    and differ from the unedited logits."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    with torch.no_grad(), model.trace(ids, **inputs):
        model.vision.layers[0].self_attn.attention_probabilities = torch.full((TILES, 2, 17, 17), 1 / 17)
        edited = model.logits.save()
    module = model._module.model.vision_tower.encoder.layer[0].attention

    def mean_per_tile(hidden_states, *args, **kwargs):
        values = module.v_proj(hidden_states)
        return module.projection_layer(values.mean(1, keepdim=True).expand_as(values)), None

    handle = module.register_forward_hook(lambda m, args, kwargs, out: mean_per_tile(*args, **kwargs), with_kwargs=True)
    try:
        with torch.no_grad():
            expected = model._module(input_ids=ids, **inputs).logits
    finally:
        handle.remove()
    with torch.no_grad():
        plain = model._module(input_ids=ids, **inputs).logits
    assert torch.allclose(edited, expected, atol=5e-5)
    assert not torch.allclose(expected, plain, atol=1e-3)


def test_support_says_what_the_tower_and_the_language_model_do(model):
    vision = model.vision.support(0)
    assert "lambda_1" in vision.notes["self_attn.attention_output"] and "lambda_2" in vision.notes["mlp.mlp_output"]
    assert "all heads" in vision.notes["self_attn.attention_queries"]
    assert "no logits" in vision["logits"]
    assert "causally" in model.support(0).notes["self_attn.attention_probabilities"]
