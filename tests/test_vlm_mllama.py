"""Mllama (Llama 3.2 Vision) with images on the transformers engine: its cross-attention blocks under the
cross-attention vocabulary, and its vision tower's two stacks (`model.vision`, `model.vision_global`), against
transformers' own attention weights, hand computations and the identities.

The tiny model (`models.tiny("mllama")`): a 3-block language model whose block 1 is a cross-attention block (tanh
gates drawn off zero), image token 129; a vision tower over 32 x 32 tiles (4 x 4 patches of 8 pixels and a class
token: 17 keys per tile; the tower pads each tile to 24 positions), at most 2 tiles per image, 2 local and 2 gated
tower blocks.
"""

from __future__ import annotations

import pytest
import torch

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.mllama import MllamaMultimodal, cross_attention_mask

IMAGE = 129
PER_TILE = 17


def _inputs(ids, images):
    """The processor's inputs for `ids` [1, seq] and `images`: (aspect ratio id, tiles) per image; each image's
    tokens from its <|image|> token on see its real tiles, up to the next image's token (as the processor masks)."""
    length, count = ids.shape[1], len(images)
    starts = [*(ids[0] == IMAGE).nonzero().flatten().tolist(), length]
    mask = torch.zeros(1, length, count, 2, dtype=torch.long)
    for i, (_, tiles) in enumerate(images):
        end = length if i == count - 1 else starts[i + 1]
        mask[0, starts[i] : end, i, :tiles] = 1
    return {
        "pixel_values": torch.randn(1, count, 2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
        "aspect_ratio_ids": torch.tensor([[ratio for ratio, _ in images]]),
        "aspect_ratio_mask": torch.tensor([[[1] * tiles + [0] * (2 - tiles) for _, tiles in images]]),
        "cross_attention_mask": mask,
    }


#: Two images: the first cut into 1 x 2 tiles (aspect ratio id 2), the second one tile (id 1) and a padding tile.
TWO = torch.tensor([[1, 40, IMAGE, 41, 42, IMAGE, 43, 44]])
TWO_IMAGES = [(2, 2), (1, 1)]
#: One image of two real tiles: every key is seen by every row (those before the image unmasked).
ONE = torch.tensor([[1, 40, IMAGE, 41, 42, 43]])
ONE_IMAGE = [(2, 2)]


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("mllama")


def test_every_pattern_equals_transformers_attention_with_two_images(model):
    """Block 0 and 2's self-attention patterns and block 1's cross-attention pattern are torch.equal to
    `output_attentions`, the logits to the model's; the cross pattern's rows follow the processor's mask: every key
    (unmasked) before the first image, one image's real tiles after each <|image|> token, zero on the padding tile."""
    inputs = _inputs(TWO, TWO_IMAGES)
    with torch.no_grad():
        own = model._module(input_ids=TWO, output_attentions=True, **inputs)
    with torch.no_grad(), model.trace(TWO, **inputs):
        first = model.layers[0].self_attn.attention_probabilities.save()
        cross = model.layers[1].cross_attn.attention_probabilities.save()
        last = model.layers[2].self_attn.attention_probabilities.save()
        logits = model.logits.save()
    assert all(torch.equal(a, b) for a, b in zip((first, cross, last), own.attentions))
    assert torch.equal(logits, own.logits)
    assert cross.shape == (1, 4, 8, 2 * 2 * PER_TILE)  # images x tiles x (class token + 16 patches)
    image0, image1 = slice(0, 2 * PER_TILE), slice(2 * PER_TILE, 3 * PER_TILE)
    assert (cross[0, :, :2] > 0).all()  # rows before the first image see no image: unmasked, every key
    assert (cross[0, :, 2:5, image0] > 0).all() and (cross[0, :, 2:5, image0.stop :] == 0).all()
    assert (cross[0, :, 5:, image1] > 0).all() and (cross[0, :, 5:, : image1.start] == 0).all()
    assert (cross[0, :, :, image1.stop :][:, 2:] == 0).all()  # the padding tile of image 1


def test_the_cross_scores_are_the_hand_computed_ones(model):
    """The cross scores equal queries @ keys^T * scale plus Mllama's mask as `cross_attention_mask` writes it from
    the processor's (within 1e-5), and their softmax is the pattern; the keys are the projected vision states."""
    inputs = _inputs(TWO, TWO_IMAGES)
    with torch.no_grad(), model.trace(TWO, **inputs):
        attn = model.layers[1].cross_attn
        q, k = attn.attention_queries.save(), attn.attention_keys.save()
        scores, probs = attn.attention_scores.save(), attn.attention_probabilities.save()
    heads = model.layers[1].cross_attn.heads
    assert k.shape == (1, heads.num_kv_heads, 2 * 2 * PER_TILE, heads.qk_head_dim)
    repeated = k.repeat_interleave(heads.num_heads // heads.num_kv_heads, dim=1)
    expected = q @ repeated.transpose(-1, -2) * heads.scale + cross_attention_mask(
        model.config, inputs["cross_attention_mask"]
    )
    assert torch.allclose(scores, expected, atol=1e-5, rtol=1e-5)
    assert torch.allclose(expected.softmax(-1), probs, atol=1e-6)


def test_the_identities_hold_on_every_block_with_an_image(model):
    """Every identity of the self-attention blocks and of the cross-attention block (its gated residual adds, the
    MLP zeroed on rows that see no image) on a prompt whose rows see every key."""
    inputs = _inputs(ONE, ONE_IMAGE)
    saved = read_everything(model, ONE, **inputs)
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]
    assert (1, "cross_attention_probabilities") in saved and (1, "attention_probabilities") not in saved


def test_the_identities_see_the_gates(model, monkeypatch):
    """Can fail: an oracle that adds the cross-attention block's updates ungated fails both residual identities."""
    saved = read_everything(model, ONE, **_inputs(ONE, ONE_IMAGE))
    plain = attnlens.parts.identities.Identities.residual_add
    monkeypatch.setattr(MllamaMultimodal.Identities, "residual_add", lambda self, *a, **k: plain(self, *a))
    found = failures(model, saved, 1)
    assert "cross attention input + cross attention output == layer mid" in found
    assert "layer mid + mlp output == layer output" in found


def test_support_says_which_block_kind_serves_what(model):
    """The cross block serves the cross-attention values, its self-attention ones refused with the reason; a
    self-attention block the other way round; the gates and the keys' layout are in the notes."""
    cross, own = model.support(1), model.support(0)
    assert cross["cross_attn.attention_probabilities"] is None and own["self_attn.attention_probabilities"] is None
    assert "is a cross-attention block" in cross["self_attn.attention_probabilities"]
    assert "is a self-attention block" in own["cross_attn.attention_probabilities"]
    assert "layers [1]" in own["cross_attention_input"]
    assert "tanh(cross_attn_attn_gate)" in cross.notes["layer_mid"]
    assert "class token" in cross.notes["cross_attn.attention_keys"]
    assert "model.vision_global" in cross.notes["cross_attn.attention_keys"]
    with pytest.raises(attnlens.Unavailable, match="is a cross-attention block"):
        with torch.no_grad(), model.trace(ONE, **_inputs(ONE, ONE_IMAGE)):
            model.layers[1].self_attn.attention_probabilities.save()


def test_positions_name_the_image_tokens_and_the_cross_keys(model):
    """Each <|image|> token is its image's (a 1 x 1 grid); `keys` names each cross key's image, tile, tile place and
    patch row and column (-1 on class tokens), padding tiles not real; `on_image` lays a row of a pattern onto the
    image as the processor tiled it."""
    inputs = _inputs(TWO, TWO_IMAGES)
    found = model.positions(TWO, **inputs)
    assert found.spans() == {"text": [0, 1, 3, 4, 6, 7], "special": [], "image 0": [2], "image 1": [5]}
    keys = found.keys
    assert keys.image.shape == (1, 68) and keys.patches == 4 and keys.tiles == (((1, 2), (1, 1)),)
    assert keys.image[0].tolist() == [0] * 34 + [1] * 34
    assert keys.tile[0, [0, 17, 34, 51]].tolist() == [0, 1, 0, 1]
    assert keys.patch_row[0, :6].tolist() == [-1, 0, 0, 0, 0, 1] and keys.patch_col[0, :6].tolist() == [
        -1,
        0,
        1,
        2,
        3,
        0,
    ]
    assert keys.real[0].tolist() == [True] * 51 + [False] * 17
    assert keys.tile_col[0, [0, 17, 34, 51]].tolist() == [0, 1, 0, -1]
    row = torch.arange(68.0)
    laid = keys.on_image(row, 0)
    assert laid.shape == (4, 8)  # one row of tiles, two tiles across, 4 x 4 patches each
    assert laid[0].tolist() == [1.0, 2.0, 3.0, 4.0, 18.0, 19.0, 20.0, 21.0]
    assert keys.on_image(row, 1).shape == (4, 4)
    assert model.positions(ONE).keys is None  # no images given


def test_an_edit_of_the_cross_pattern_moves_the_logits_as_recomputing_by_hand_predicts(model):
    """Every row of the cross pattern put on one key (image 0, tile 1, patch row 1, column 2): the logits equal a
    hand-run of the model whose cross-attention outputs o_proj(that key's value) for every head and row."""
    inputs = _inputs(TWO, TWO_IMAGES)
    key = PER_TILE + 1 + 1 * 4 + 2
    with torch.no_grad(), model.trace(TWO, **inputs):
        attn = model.layers[1].cross_attn
        pattern = attn.attention_probabilities
        edited_pattern = torch.zeros_like(pattern)
        edited_pattern[..., key] = 1.0
        attn.attention_probabilities = edited_pattern
        edited = model.logits.save()
    with torch.no_grad():
        plain = model._module(input_ids=TWO, **inputs).logits
    module = model._module.model.language_model.layers[1].cross_attn

    def one_key(hidden_states, cross_attention_states=None, **kwargs):
        b, n, _ = hidden_states.shape
        values = module.v_proj(cross_attention_states).view(b, -1, module.num_key_value_heads, module.head_dim)
        chosen = values[:, key].repeat_interleave(module.num_key_value_groups, dim=1)
        return module.o_proj(chosen.reshape(b, 1, -1).expand(b, n, -1)), None

    original = module.forward
    module.forward = one_key
    try:
        with torch.no_grad():
            expected = model._module(input_ids=TWO, **inputs).logits
    finally:
        module.forward = original
    assert torch.allclose(edited, expected, atol=1e-5)
    assert not torch.allclose(edited, plain, atol=1e-3)  # the edit moved them


def test_text_alone_skips_the_cross_block_and_the_text_model_keeps_its_family():
    """Without images the composite runs its self-attention blocks only (block 1 skipped: the stream passes it), as
    the text model (`mllama_text_model`, its own family) always does."""
    model = attnlens.models.tiny("mllama")
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.no_grad(), model.trace(ids):
        out0 = model.layers[0].layer_output.save()
        in2 = model.layers[2].layer_input.save()
    assert torch.equal(out0, in2)
    text = attnlens.models.tiny("mllama_text_model")
    assert text.family.name == "Mllama" and type(text._module).__name__ == "MllamaForCausalLM"


# --- the vision tower: model.vision (the local stack), model.vision_global (the gated stack) -------------------------

#: Positions of a tile in the towers' sequences: its class token and 16 patches, then 7 padding rows (to 24).
TILE = 24


def _tower_attentions(model, prompt, inputs):
    """transformers' own eager attention weights of every tower block (the local stack's, then the global's), as each
    `MllamaVisionAttention` returns them, and the logits."""
    vision = model._module.model.vision_model
    blocks = [*vision.transformer.layers, *vision.global_transformer.layers]
    found = []
    hooks = [block.self_attn.register_forward_hook(lambda m, a, out: found.append(out[1])) for block in blocks]
    try:
        with torch.no_grad():
            logits = model._module(input_ids=prompt, **inputs).logits
    finally:
        for hook in hooks:
            hook.remove()
    return found, logits


def test_every_pattern_of_both_tower_stacks_equals_transformers_attention(model):
    """Each local block's (`model.vision`) and gated block's (`model.vision_global`) pattern is torch.equal to the
    weights transformers' eager attention returns, on the two-image prompt (one image with a padding tile); the
    towers' sequence is one per image, two tiles of 24 positions."""
    inputs = _inputs(TWO, TWO_IMAGES)
    expected, logits = _tower_attentions(model, TWO, inputs)
    found = []
    with torch.no_grad(), model.trace(TWO, **inputs):
        for stack in (model.vision, model.vision_global):
            for i in range(2):
                found.append(stack.layers[i].self_attn.attention_probabilities.save())
        own = model.logits.save()
    assert len(expected) == 4 and all(torch.equal(a, b) for a, b in zip(found, expected))
    assert torch.equal(own, logits)
    assert found[0].shape == (2, 2, 2 * TILE, 2 * TILE)


def test_the_towers_mask_only_the_pairs_of_padding_positions(model):
    """A padding position (a tile's 7 padding rows, every position of image 1's padding tile) gets zero from every
    padding position and weight from every real one; a real position sees every position; the score function, given
    the padding (`segments`), gives the scores; the identities hold on every block of both stacks."""
    inputs = _inputs(TWO, TWO_IMAGES)
    saved = read_everything(model, TWO, **inputs)
    padding = torch.zeros(2, 2 * TILE, dtype=torch.bool)
    padding[:, 17:TILE] = padding[:, TILE + 17 :] = True
    padding[1, TILE:] = True  # image 1's second tile
    assert torch.equal(saved["vision"][(0, "segments")] < 0, padding)
    for name in ("vision", "vision_global"):
        pattern = saved[name][(1, "attention_probabilities")]
        both = padding[:, :, None] & padding[:, None, :]
        assert (pattern.transpose(0, 1)[:, both] == 0).all() and (pattern.transpose(0, 1)[:, ~both] > 0).all()
        stack = getattr(model, name)
        assert [failures(stack, saved[name], i) for i in range(2)] == [[], []]


def test_the_tower_checks_fail_without_the_padding_mask(model):
    """Can fail: with the padding left out (every position seeing every one), the score function's scores and the
    visible entries disagree with the model's, on both stacks."""
    saved = read_everything(model, TWO, **_inputs(TWO, TWO_IMAGES))
    for name in ("vision", "vision_global"):
        del saved[name][(0, "segments")]
        found = failures(getattr(model, name), saved[name], 0)
        assert "scores == family score function" in found and "visible entries positive" in found


def test_the_gated_blocks_identities_see_their_gates(model, monkeypatch):
    """Can fail: an oracle adding the global blocks' updates ungated fails both residual identities there."""
    from attnlens.families.vision_mllama import MllamaVisionTower

    saved = read_everything(model, ONE, **_inputs(ONE, ONE_IMAGE))
    plain = attnlens.parts.identities.Identities.residual_add
    monkeypatch.setattr(MllamaVisionTower.Identities, "residual_add", lambda self, *a, **k: plain(self, *a))
    found = failures(model.vision_global, saved["vision_global"], 0)
    assert "layer input + attention output == layer mid" in found and "layer mid + mlp output == layer output" in found
    assert failures(model.vision, saved["vision"], 0) == []  # the local blocks have no gate


@pytest.fixture(scope="module")
def gates_open():
    """The tiny model with its global blocks' gates at 1: transformers draws them near zero (std 0.02), where what
    the gated blocks compute barely reaches the logits."""
    model = attnlens.models.tiny("mllama")
    with torch.no_grad():
        for block in model._module.model.vision_model.global_transformer.layers:
            block.gate_attn.fill_(1.0)
            block.gate_ffn.fill_(1.0)
    return model


@pytest.mark.parametrize(("stack", "block"), [("vision", 0), ("vision_global", 1)])
def test_an_edit_of_a_tower_pattern_moves_the_logits_as_recomputing_by_hand_predicts(gates_open, stack, block):
    """Uniform attention in a tower block (local block 0, whose output the projector also reads; the last gated
    block): the logits equal a hand-run of the model with that block's attention replaced by o_proj of the mean of
    its values over every position (padding rows too), and differ from the plain logits."""
    model = gates_open
    inputs = _inputs(TWO, TWO_IMAGES)
    with torch.no_grad(), model.trace(TWO, **inputs):
        attn = getattr(model, stack).layers[block].self_attn
        pattern = attn.attention_probabilities
        attn.attention_probabilities = torch.full_like(pattern, 1 / pattern.shape[-1])
        edited = model.logits.save()
    vision = model._module.model.vision_model
    module = (vision.transformer if stack == "vision" else vision.global_transformer).layers[block].self_attn

    def uniform(hidden_states, attention_mask=None, **kwargs):
        b, n, _ = hidden_states.shape
        mixed = module.v_proj(hidden_states).mean(1, keepdim=True).expand(b, n, -1)
        return module.o_proj(mixed), None

    original = module.forward
    module.forward = uniform
    try:
        with torch.no_grad():
            expected = model._module(input_ids=TWO, **inputs).logits
    finally:
        module.forward = original
    with torch.no_grad():
        plain = model._module(input_ids=TWO, **inputs).logits
    assert torch.allclose(edited, expected, atol=1e-5)
    assert not torch.allclose(edited, plain, atol=1e-4)  # moved by 1e-3 (the gated block) and more


def test_the_stacks_read_in_forward_order_local_then_global_then_the_language_model(model):
    """`model.vision` runs before `model.vision_global`, both before the language model: read so, the global stack's
    input is layernorm_post of the local stack's output plus the gated post-tile embedding (by hand); the reverse
    order is refused by name."""
    inputs = _inputs(TWO, TWO_IMAGES)
    with torch.no_grad(), model.trace(TWO, **inputs):
        local = model.vision.layers[-1].layer_output.save()
        handed = model.vision_global.embeddings.save()
        keys = model.layers[1].cross_attn.attention_keys.save()
    vision = model._module.model.vision_model
    with torch.no_grad():
        tiles = vision.layernorm_post(local).reshape(2, 2, TILE, -1)  # images, tiles, positions, width
        ratios = inputs["aspect_ratio_ids"].reshape(2, 1)
        expected = vision.post_tile_positional_embedding(tiles, ratios).reshape(2, 2 * TILE, -1)
    assert torch.allclose(handed, expected, atol=1e-6) and keys.shape[2] == 4 * PER_TILE
    with pytest.raises(attnlens.OrderError, match="vision"):
        with torch.no_grad(), model.trace(TWO, **inputs):
            model.vision_global.layers[0].self_attn.attention_probabilities.save()
            model.vision.layers[1].self_attn.attention_probabilities.save()


def test_the_towers_support_says_what_they_serve(model):
    """Both stacks serve the attention values; the notes give the layout, the padding mask and the gates; the
    stacks' ends say where their outputs go."""
    local, gated = model.vision.support(0), model.vision_global.support(0)
    assert local["self_attn.attention_probabilities"] is None and gated["self_attn.attention_probabilities"] is None
    assert "two padding positions" in local.notes["self_attn.attention_probabilities"]
    assert "tanh(gate_attn)" in gated.notes["layer_mid"] and "layernorm_post" in gated.notes["embeddings"]
    assert "layernorm_post" in local["final_norm_output"] and "projector" in gated["final_norm_output"]
    assert "no logits" in local["logits"]
