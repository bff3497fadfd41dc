"""Qwen3.5 and Qwen3.5-MoE with images on the transformers engine: the hybrid language model (Gated DeltaNet layers
and full-attention layers rotated by interleaved M-RoPE) and Qwen3.5's ViT as `model.vision`, against transformers'
own attention weights, hand computations of the multimodal rotary positions and of the tower's learned positions, and
the identities.

The tiny composites (`models.tiny_model("qwen3_5", checkpoint=True)`, and "qwen3_5_moe"): a one-block ViT over patches
of 16 pixels (two frames each) with learned positions on a 48 x 48 grid, merged 2 x 2 into the language model's image
tokens (id 129, between 130 and 131); a 3-layer language model (Qwen3.5: layers 0 and 1 Gated DeltaNet, 2 full
attention; Qwen3.5-MoE: 1 full attention) whose 32-wide full-attention heads rotate their first 8 dimensions (4
frequencies) by M-RoPE's sections [2, 1, 1], interleaved: frequencies 0 and 3 by the temporal id, 1 by the row, 2 by
the column. The prompt comes from the tiny processor (`models.tiny_processor`): a 64 x 64 image (4 x 4 patches, 2 x 2
tokens) and a 96 x 64 one (6 x 4 patches, 3 x 2 tokens).
"""

from __future__ import annotations

import pytest
import torch
from images import (
    logits_with_last_qwen_tower_block_uniform_within_each_image,
    random_image,
    resampled_learned_positions,
    rotated_by_interleaved_mrope,
    towers_own_weights_per_image,
)

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.models import char_tokenizer, tiny_model, tiny_processor

TYPES = ["qwen3_5", "qwen3_5_moe"]
TEXT = "ab<|vision_start|><|image_pad|><|vision_end|>cd<|vision_start|><|image_pad|><|vision_end|>ef"
IMAGE, START, END = 129, 130, 131
FIRST, SECOND = [3, 4, 5, 6], [11, 12, 13, 14, 15, 16]
PATCHES = 16 + 24


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


def full_layers(model):
    return [i for i in range(model.num_layers) if model.support(i)["self_attn.attention_probabilities"] is None]


def test_the_processor_lays_the_two_images_out(model, inputs):
    ids, rest = split(inputs)
    expected = [68, 69, START, *[IMAGE] * 4, END, 70, 71, START, *[IMAGE] * 6, END, 72, 73]
    assert ids.tolist() == [expected]
    assert rest["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4]]
    assert rest["pixel_values"].shape == (PATCHES, 3 * 2 * 16 * 16)
    assert rest["mm_token_type_ids"].tolist() == [[int(i == IMAGE) for i in expected]]


def test_every_language_pattern_equals_transformers_attention_and_the_linear_layers_have_none(model, inputs):
    """The full-attention layers' patterns on the two-image prompt are torch.equal to `output_attentions` (which holds
    those layers only), the logits and every layer's output (the residual stream: nothing of the tower is added after
    the first layer) equal the model's hidden states; the Gated DeltaNet layers serve no pattern, with the reason."""
    ids, rest = split(inputs)
    with torch.no_grad():
        own = model._module(**inputs, output_attentions=True, output_hidden_states=True)
    full = full_layers(model)
    found, outputs = {}, []
    with torch.no_grad(), model.trace(ids, **rest):
        for i in range(model.num_layers):
            if i in full:
                found[i] = model.layers[i].self_attn.attention_probabilities.save()
            outputs.append(model.layers[i].layer_output.save())
        logits = model.logits.save()
    assert len(full) == len(own.attentions) == 1
    assert all(torch.equal(found[i], expected) for i, expected in zip(full, own.attentions))
    assert torch.equal(logits, own.logits)
    assert len(own.hidden_states) == model.num_layers + 1  # the embeddings, then each layer's output (the last normed)
    assert all(torch.equal(outputs[i], own.hidden_states[i + 1]) for i in range(model.num_layers - 1))
    pattern = found[full[0]][0, :, FIRST][..., FIRST]
    below = torch.ones(4, 4, dtype=torch.bool).tril()
    assert (pattern[:, ~below] == 0).all() and (pattern[:, below] > 0).all()  # causal over an image's tokens
    linear = [i for i in range(model.num_layers) if i not in full]
    assert linear and all("Gated DeltaNet" in model.support(i)["self_attn.attention_probabilities"] for i in linear)
    with pytest.raises(attnlens.Unavailable, match="Gated DeltaNet"), torch.no_grad(), model.trace(ids, **rest):
        model.layers[linear[0]].self_attn.attention_probabilities.save()


def test_every_tower_pattern_equals_the_weights_transformers_computes(model, inputs, monkeypatch):
    """Each tower block's pattern [1, heads, patches, patches] is torch.equal to the weights transformers' eager
    function returns per image, assembled block-diagonally (zeros off each image's block); the last block's output
    is the tower's."""
    ids, rest = split(inputs)
    expected = towers_own_weights_per_image(model, inputs, monkeypatch, PATCHES)
    found = []
    with torch.no_grad(), model.trace(ids, **rest):
        for i in range(model.vision.num_layers):
            found.append(model.vision.layers[i].self_attn.attention_probabilities.save())
        last = model.vision.layers[-1].layer_output.save()
    assert len(found) == len(expected) == model.vision.num_layers
    assert all(torch.equal(a, b) for a, b in zip(found, expected))
    with torch.no_grad():
        tower = model._module.model.visual(rest["pixel_values"], grid_thw=rest["image_grid_thw"])
    assert torch.equal(last[0], tower.last_hidden_state)


def test_the_identities_hold_on_both_stacks_with_images(model, inputs):
    """Every identity of the tower's blocks (segments from image_grid_thw) and of every language-model layer (the
    Gated DeltaNet layers' too) on the two-image prompt; without the segments the tower's checks fail (a test that
    can fail)."""
    ids, rest = split(inputs)
    saved = read_everything(model, ids, **rest)
    tower = model.vision.num_layers
    assert [failures(model.vision, saved["vision"], i) for i in range(tower)] == [[]] * tower
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[]] * model.num_layers
    for i in range(tower):
        del saved["vision"][(i, "segments")]
    assert "visible entries positive" in failures(model.vision, saved["vision"], 0)


def test_positions_place_every_image_token_on_its_grid(model, inputs):
    found = model.positions(inputs)
    spans = {"text": [0, 1, 8, 9, 18, 19], "special": [2, 7, 10, 17], "image 0": FIRST, "image 1": SECOND}
    assert found.spans() == spans
    assert found.grids == (((2, 2), (3, 2)),)
    assert found.row[0, SECOND].tolist() == [0, 0, 1, 1, 2, 2] and found.col[0, SECOND].tolist() == [0, 1] * 3


def test_the_queries_and_keys_are_rotated_by_the_multimodal_positions(model, inputs):
    """The full-attention layer's queries and keys equal, within 1e-5, its projections (q_norm, k_norm) rotated by
    hand by interleaved M-RoPE on `get_rope_index`'s ids, and not rotated by plain 1-D positions (which the model
    would use without mm_token_type_ids): an image's tokens share a temporal id and take their grid's rows and columns,
    and the text after an image counts on from its start plus max(h, w) / 2."""
    ids, rest = split(inputs)
    layer = full_layers(model)[0]
    with torch.no_grad(), model.trace(ids, **rest):
        normed = model.layers[layer].attention_norm_output.save()
        queries = model.layers[layer].self_attn.attention_queries.save()
        keys = model.layers[layer].self_attn.attention_keys.save()
    rope, _ = model._module.model.get_rope_index(ids, rest["mm_token_type_ids"], rest["image_grid_thw"])
    assert rope[:, 0, FIRST].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]  # (temporal, row, column)
    assert rope[:, 0, 7].tolist() == [5] * 3 and rope[:, 0, 10].tolist() == [8] * 3  # end: 3 + max(2, 2); start
    assert rope[:, 0, SECOND].tolist() == [[9] * 6, [9, 9, 10, 10, 11, 11], [9, 10] * 3]
    assert rope[:, 0, 17:].tolist() == [[12, 13, 14]] * 3  # the end token at 9 + max(3, 2), then the text
    attention = model._module.model.language_model.layers[layer].self_attn
    text = model.config.text_config
    n = ids.shape[1]
    with torch.no_grad():
        projected = attention.q_proj(normed).view(1, n, -1, 2 * text.head_dim)
        raw_queries = attention.q_norm(projected[..., : text.head_dim]).transpose(1, 2)
        raw_keys = attention.k_norm(attention.k_proj(normed).view(1, n, -1, text.head_dim)).transpose(1, 2)
    assert torch.allclose(queries, rotated_by_interleaved_mrope(raw_queries, rope[:, 0], text), atol=1e-5)
    assert torch.allclose(keys, rotated_by_interleaved_mrope(raw_keys, rope[:, 0], text), atol=1e-5)
    flat = torch.arange(n).expand(3, n)
    assert not torch.allclose(queries, rotated_by_interleaved_mrope(raw_queries, flat, text), atol=1e-3)
    assert "not its rotary position" in model.support(layer).notes["self_attn.attention_key_positions"]


def test_the_towers_embeddings_are_the_patches_with_the_resampled_learned_positions(model, inputs):
    """`model.vision.embeddings` (what the first block reads) is the patch embedding plus the learned positions,
    bilinearly resampled (corners aligned) from the 48 x 48 grid to each image's patch grid by hand, in the
    processor's order (2 x 2 blocks of patches row-major, each block row-major): within 1e-5."""
    ids, rest = split(inputs)
    with torch.no_grad(), model.trace(ids, **rest):
        embeddings = model.vision.embeddings.save()
    visual = model._module.model.visual
    positions = resampled_learned_positions(visual, rest["image_grid_thw"])
    with torch.no_grad():
        expected = visual.patch_embed(rest["pixel_values"]) + positions
    assert embeddings.shape == (1, PATCHES, 32)
    assert torch.allclose(embeddings[0], expected, atol=1e-5)


def test_an_edit_of_the_towers_embeddings_moves_the_logits_as_a_hook_on_transformers_predicts(model, inputs):
    """Adding to the second image's rows of `model.vision.embeddings` gives the logits a forward pre-hook adding the
    same to the first tower block's input gives plain transformers (torch.equal), and they differ from the unedited."""
    ids, rest = split(inputs)
    shift = torch.linspace(-1, 1, 32)
    with torch.no_grad(), model.trace(ids, **rest):
        model.vision.embeddings[0, 16:] += shift
        edited = model.logits.save()

    def hook(module, args, kwargs):
        hidden = args[0].clone()
        hidden[16:] += shift
        return (hidden, *args[1:]), kwargs

    handle = model._module.model.visual.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            expected = model._module(**inputs).logits
    finally:
        handle.remove()
    with torch.no_grad():
        plain = model._module(**inputs).logits
    assert torch.equal(edited, expected) and not torch.allclose(edited, plain, atol=1e-3)


def test_an_edit_of_the_towers_head_outputs_moves_the_logits_as_recomputing_by_hand_predicts(model, inputs):
    """Uniform attention within each image on the tower's last block, by assigning its head outputs (the pattern is
    read-only: the model mixes each image before the next starts): the logits equal a hand-run of the model with
    that block's attention mixing the mean of each image's values (within 1e-4), not the unedited ones."""
    ids, rest = split(inputs)
    last = model.vision.layers[-1]
    segment = model.vision.family.segments(model.vision.config, rest, model.vision.num_layers - 1)[0]
    bounds = [0, *torch.bincount(segment).cumsum(0).tolist()]
    assert bounds == [0, 16, 40]
    with torch.no_grad(), model.trace(ids, **rest):
        values = last.self_attn.attention_values  # [1, heads, patches, head_dim]
        means = torch.stack([values[0, :, segment == s].mean(1) for s in range(len(bounds) - 1)])
        last.self_attn.attention_head_outputs = means[segment][None]  # [1, patches, heads, head_dim]
        edited = model.logits.save()
    expected = logits_with_last_qwen_tower_block_uniform_within_each_image(model, bounds, **inputs)
    with torch.no_grad():
        plain = model._module(**inputs).logits
    # the means summed in another order than the hand-run's: 2.4e-5 apart at most, on logits up to 5
    # the edit moves them by 4.9e-3 (Qwen3.5-MoE) to 1.3e-2 (Qwen3.5): far past that
    assert torch.allclose(edited, expected, atol=1e-4) and (edited - plain).abs().max() > 1e-3
    support = model.vision.support(0)
    assert "no logits" in support["logits"] and "merger" in support["final_norm_output"]
    assert "learned positions" in support.notes["embeddings"]
