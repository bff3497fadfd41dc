"""Qwen3-VL and Qwen3-VL-MoE with images on the transformers engine: Qwen3's language model (Qwen3-MoE's) rotated by
interleaved M-RoPE, Qwen3-VL's ViT as `model.vision`, and deepstack (features of chosen tower blocks added to the image
tokens' rows after the first language-model layers, outside any module), against transformers' own attention weights,
hand computations of the multimodal rotary positions and of the deepstack addition, and the identities.

The tiny composites (`models.tiny_model("qwen3_vl", checkpoint=True)`, and "qwen3_vl_moe"): a two-block ViT over
patches of 16 pixels (two frames each) with learned positions on a 48 x 48 grid, merged 2 x 2 into the language
model's image tokens (id 129, between 130 and 131), both blocks feeding a deepstack merger (`deepstack_visual_indexes`
[0, 1]: added after language layers 0 and 1); a 3-layer language model (Qwen3-VL-MoE: layer 0 dense, 1 and 2 sparse)
whose 16-wide heads rotate their 8 frequencies by M-RoPE's sections [2, 3, 3], interleaved. The prompt comes from the
tiny processor (`models.tiny_processor`): a 64 x 64 image (4 x 4 patches, 2 x 2 tokens) and a 96 x 64 one (6 x 4
patches, 3 x 2 tokens).
"""

from __future__ import annotations

import pytest
import torch
from images import (
    interleaved_mrope_axes,
    random_image,
    resampled_learned_positions,
    rotated_by_interleaved_mrope,
    towers_own_weights_per_image,
)

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.models import char_tokenizer, tiny_model, tiny_processor

TYPES = ["qwen3_vl", "qwen3_vl_moe"]
TEXT = "ab<|vision_start|><|image_pad|><|vision_end|>cd<|vision_start|><|image_pad|><|vision_end|>ef"
IMAGE, START, END = 129, 130, 131
FIRST, SECOND = [3, 4, 5, 6], [11, 12, 13, 14, 15, 16]
IMAGE_ROWS = FIRST + SECOND
PATCHES = 16 + 24
DEEPSTACK = 2  # features added after language layers 0 and 1


@pytest.fixture(scope="module", params=TYPES)
def model(request):
    return attnlens.StandardizedTransformer(tiny_model(request.param, checkpoint=True), tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def inputs(model):
    """The tiny processor's outputs: input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw."""
    processor = tiny_processor(model.config.model_type)
    return dict(processor(text=[TEXT], images=[random_image(64, 64, 0), random_image(96, 64, 1)], return_tensors="pt"))


def split(inputs):
    return inputs["input_ids"], {k: v for k, v in inputs.items() if k != "input_ids"}


def test_the_processor_lays_the_two_images_out(model, inputs):
    ids, rest = split(inputs)
    expected = [68, 69, START, *[IMAGE] * 4, END, 70, 71, START, *[IMAGE] * 6, END, 72, 73]
    assert ids.tolist() == [expected]
    assert rest["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4]]
    assert rest["pixel_values"].shape == (PATCHES, 3 * 2 * 16 * 16)
    assert rest["mm_token_type_ids"].tolist() == [[int(i == IMAGE) for i in expected]]


def test_every_language_pattern_equals_transformers_attention(model, inputs):
    """Every layer's pattern on the two-image prompt is torch.equal to `output_attentions`, the logits equal the
    model's, and each layer's output is the model's hidden state after that layer (which transformers records before
    the deepstack addition: the block's output); image tokens attend causally."""
    ids, rest = split(inputs)
    with torch.no_grad():
        own = model._module(**inputs, output_attentions=True, output_hidden_states=True)
    found, outputs = [], []
    with torch.no_grad(), model.trace(ids, **rest):
        for i in range(model.num_layers):
            found.append(model.layers[i].self_attn.attention_probabilities.save())
            outputs.append(model.layers[i].layer_output.save())
        logits = model.logits.save()
    assert len(found) == len(own.attentions) == model.num_layers == 3
    assert all(torch.equal(a, b) for a, b in zip(found, own.attentions))
    assert torch.equal(logits, own.logits)
    assert all(torch.equal(outputs[i], own.hidden_states[i + 1]) for i in range(model.num_layers - 1))
    pattern = found[0][0, :, FIRST][..., FIRST]
    below = torch.ones(4, 4, dtype=torch.bool).tril()
    assert (pattern[:, ~below] == 0).all() and (pattern[:, below] > 0).all()


def test_every_tower_pattern_equals_the_weights_transformers_computes(model, inputs, monkeypatch):
    """Each tower block's pattern [1, heads, patches, patches] is torch.equal to the weights transformers' eager
    function returns per image, assembled block-diagonally; the last block's output is the tower's."""
    ids, rest = split(inputs)
    expected = towers_own_weights_per_image(model, inputs, monkeypatch, PATCHES)
    found = []
    with torch.no_grad(), model.trace(ids, **rest):
        for i in range(model.vision.num_layers):
            found.append(model.vision.layers[i].self_attn.attention_probabilities.save())
        last = model.vision.layers[-1].layer_output.save()
    assert len(found) == len(expected) == model.vision.num_layers == 2
    assert all(torch.equal(a, b) for a, b in zip(found, expected))
    with torch.no_grad():
        tower = model._module.model.visual(rest["pixel_values"], grid_thw=rest["image_grid_thw"])
    assert torch.equal(last[0], tower.last_hidden_state)
    assert "deepstack" in model.vision.support(0)["final_norm_output"]


def _deepstack_by_hand(model, tower_outputs):
    """What the model adds to the image tokens' rows after language layer k: deepstack merger k over the output of
    tower block `deepstack_visual_indexes[k]` (each image's patches in the processor's order, so the merged rows are
    the image tokens' in prompt order)."""
    visual = model._module.model.visual
    indexes = model.config.vision_config.deepstack_visual_indexes
    with torch.no_grad():
        return [merger(tower_outputs[block][0]) for merger, block in zip(visual.deepstack_merger_list, indexes)]


def test_the_deepstack_addition_is_the_mergers_of_the_served_tower_blocks(model, inputs):
    """After layers 0 and 1 the next layer's input is this layer's output plus, on the image tokens' rows only, the
    deepstack merger of the tower block's served output (recomputed here from `model.vision.layers[b].layer_output`):
    torch.equal; text rows pass unchanged; the notes of those layers' outputs say so, layer 2's has none."""
    ids, rest = split(inputs)
    towers, pairs = [], []
    with torch.no_grad(), model.trace(ids, **rest):
        for i in range(model.vision.num_layers):
            towers.append(model.vision.layers[i].layer_output.save())
        for i in range(model.num_layers):
            pairs.append((model.layers[i].layer_input.save(), model.layers[i].layer_output.save()))
    added = _deepstack_by_hand(model, towers)
    assert len(added) == DEEPSTACK and added[0].shape == (len(IMAGE_ROWS), model.config.text_config.hidden_size)
    for k in range(DEEPSTACK):
        output, following = pairs[k][1], pairs[k + 1][0]
        expected = output.clone()
        expected[0, IMAGE_ROWS] = expected[0, IMAGE_ROWS] + added[k]
        assert torch.equal(following, expected)
        text_rows = [i for i in range(ids.shape[1]) if i not in IMAGE_ROWS]
        assert torch.equal(following[0, text_rows], output[0, text_rows])
        assert (following[0, IMAGE_ROWS] - output[0, IMAGE_ROWS]).abs().max() > 1e-2  # not a vanishing addition
        assert f"deepstack merger {k}'s output" in model.support(k).notes["layer_output"]
    assert "layer_output" not in model.support(DEEPSTACK).notes
    assert "deepstack merger 1" in model.vision.support(1).notes["layer_output"]


def test_the_identities_hold_on_both_stacks_with_images_and_fail_without_the_addition(model, inputs):
    """Every identity of the tower's blocks and of every language-model layer on the two-image prompt, the residual
    between layers knowing the deepstack addition (`added_between_blocks`); without it the layers it follows fail
    "layer output == next layer input" (a test that can fail), and without the segments the tower's checks fail."""
    ids, rest = split(inputs)
    saved = read_everything(model, ids, **rest)
    tower = model.vision.num_layers
    assert [failures(model.vision, saved["vision"], i) for i in range(tower)] == [[]] * tower
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[]] * model.num_layers
    rows, features = saved["added_between_blocks"]
    assert rows[0].nonzero().flatten().tolist() == IMAGE_ROWS and len(features) == DEEPSTACK
    del saved["added_between_blocks"]
    ignored = [failures(model, saved, i) for i in range(model.num_layers)]
    assert ignored == [["layer output == next layer input"]] * DEEPSTACK + [[]]
    for i in range(tower):
        del saved["vision"][(i, "segments")]
    assert "visible entries positive" in failures(model.vision, saved["vision"], 0)


def test_a_text_prompt_adds_nothing_between_the_layers(model):
    """Without images the tower does not run, nothing is added: each layer's output is the next layer's input and
    every identity holds."""
    ids = torch.tensor([[68, 69, 70, 71, 72]])
    saved = read_everything(model, ids)
    assert "added_between_blocks" not in saved
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[]] * model.num_layers
    assert torch.equal(saved[(0, "layer_output")], saved[(1, "layer_input")])


def test_positions_place_every_image_token_on_its_grid(model, inputs):
    found = model.positions(inputs)
    spans = {"text": [0, 1, 8, 9, 18, 19], "special": [2, 7, 10, 17], "image 0": FIRST, "image 1": SECOND}
    assert found.spans() == spans
    assert found.grids == (((2, 2), (3, 2)),)
    assert found.row[0, SECOND].tolist() == [0, 0, 1, 1, 2, 2] and found.col[0, SECOND].tolist() == [0, 1] * 3


def test_the_queries_and_keys_are_rotated_by_the_multimodal_positions(model, inputs):
    """Layer 1's queries and keys (its input holds the first deepstack addition) equal, within 1e-5, its projections
    (q_norm, k_norm) rotated by hand by interleaved M-RoPE on `get_rope_index`'s ids, and not by plain 1-D positions:
    an image's tokens share a temporal id and take their grid's rows and columns, and the text after an image counts
    on from its start plus max(h, w) / 2."""
    ids, rest = split(inputs)
    layer = 1
    with torch.no_grad(), model.trace(ids, **rest):
        normed = model.layers[layer].attention_norm_output.save()
        queries = model.layers[layer].self_attn.attention_queries.save()
        keys = model.layers[layer].self_attn.attention_keys.save()
    rope, _ = model._module.model.get_rope_index(ids, rest["mm_token_type_ids"], rest["image_grid_thw"])
    assert rope[:, 0, FIRST].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]  # (temporal, row, column)
    assert rope[:, 0, 7].tolist() == [5] * 3 and rope[:, 0, 10].tolist() == [8] * 3
    assert rope[:, 0, SECOND].tolist() == [[9] * 6, [9, 9, 10, 10, 11, 11], [9, 10] * 3]
    assert rope[:, 0, 17:].tolist() == [[12, 13, 14]] * 3
    attention = model._module.model.language_model.layers[layer].self_attn
    text = model.config.text_config
    n = ids.shape[1]
    with torch.no_grad():
        raw_queries = attention.q_norm(attention.q_proj(normed).view(1, n, -1, text.head_dim)).transpose(1, 2)
        raw_keys = attention.k_norm(attention.k_proj(normed).view(1, n, -1, text.head_dim)).transpose(1, 2)
    assert interleaved_mrope_axes(text, raw_queries.shape[-1]) == [0, 1, 2, 0, 1, 2, 0, 1]  # the whole head turns
    assert torch.allclose(queries, rotated_by_interleaved_mrope(raw_queries, rope[:, 0], text), atol=1e-5)
    assert torch.allclose(keys, rotated_by_interleaved_mrope(raw_keys, rope[:, 0], text), atol=1e-5)
    flat = torch.arange(n).expand(3, n)
    assert not torch.allclose(queries, rotated_by_interleaved_mrope(raw_queries, flat, text), atol=1e-3)
    assert "not its rotary position" in model.support(layer).notes["self_attn.attention_key_positions"]


def test_the_towers_embeddings_are_the_patches_with_the_resampled_learned_positions(model, inputs):
    """`model.vision.embeddings` is the patch embedding plus the learned positions, bilinearly resampled (corners
    aligned) from the 48 x 48 grid to each image's patch grid by hand, in the processor's order: within 1e-5."""
    ids, rest = split(inputs)
    with torch.no_grad(), model.trace(ids, **rest):
        embeddings = model.vision.embeddings.save()
    visual = model._module.model.visual
    positions = resampled_learned_positions(visual, rest["image_grid_thw"])
    with torch.no_grad():
        expected = visual.patch_embed(rest["pixel_values"]) + positions
    assert embeddings.shape == (1, PATCHES, 32)
    assert torch.allclose(embeddings[0], expected, atol=1e-5)


def _logits_with_hook(model, inputs, module, hook):
    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model._module(**inputs).logits
    finally:
        handle.remove()


def test_an_edit_of_a_layer_output_lands_before_the_deepstack_addition_as_a_hook_on_transformers_predicts(
    model, inputs
):
    """Adding to the image rows of layer 0's `layer_output` gives the logits a forward hook adding the same to the
    decoder layer's output gives plain transformers (torch.equal): the edit lands on the block's output, the deepstack
    features added after it."""
    ids, rest = split(inputs)
    shift = torch.linspace(-1, 1, model.config.text_config.hidden_size)
    with torch.no_grad(), model.trace(ids, **rest):
        model.layers[0].layer_output[0, IMAGE_ROWS] += shift
        edited = model.logits.save()

    def hook(module, args, output):
        output = output.clone()
        output[0, IMAGE_ROWS] += shift
        return output

    expected = _logits_with_hook(model, inputs, model._module.model.language_model.layers[0], hook)
    with torch.no_grad():
        plain = model._module(**inputs).logits
    assert torch.equal(edited, expected) and not torch.allclose(edited, plain, atol=1e-3)


def test_an_edit_of_a_deepstack_tower_block_reaches_its_merger_as_a_hook_on_transformers_predicts(model, inputs):
    """Adding to the second image's patches of tower block 0's `layer_output` (which block 1 and deepstack merger 0
    read) gives the logits a forward hook on that block gives plain transformers (torch.equal), and moves what the
    model adds after language layer 0 (the merger's output, handed to the language model) on that image's rows only."""
    ids, rest = split(inputs)
    shift = torch.linspace(-1, 1, 32)
    with torch.no_grad(), model.trace(ids, **rest):
        model.vision.layers[0].layer_output[0, 16:] += shift
        merged = model.model.visual.deepstack_merger_list[0].output.save()
        features = model.model.language_model.inputs[1]["deepstack_visual_embeds"][0].save()
        edited = model.logits.save()

    def hook(module, args, output):
        output = output.clone()
        output[16:] += shift
        return output

    expected = _logits_with_hook(model, inputs, model._module.model.visual.blocks[0], hook)
    with torch.no_grad():
        plain = model._module(**inputs).logits
        tower = model._module.model.visual(rest["pixel_values"], grid_thw=rest["image_grid_thw"])
    assert torch.equal(edited, expected) and not torch.allclose(edited, plain, atol=1e-3)
    unedited = tower.deepstack_features[0]
    assert torch.equal(features, merged)  # the merger's output, where the module docstring says to read it
    assert torch.equal(features[:4], unedited[:4]) and not torch.allclose(features[4:], unedited[4:], atol=1e-3)
