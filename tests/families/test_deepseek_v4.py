"""DeepseekV4 (attnlens/families/deepseek_v4.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import trace

import attnlens


def v4_attention(layer):
    names = (
        "attention_keys",
        "attention_values",
        "attention_probabilities",
        "attention_head_outputs",
        "attention_premix",
        "attention_output",
    )
    return lambda m: {n: getattr(m.layers[layer].self_attn, n) for n in names}


def test_v4_keys_and_values_are_one_shared_head():
    model = tiny("deepseek_v4")
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qk_head_dim) == (4, 1, 16, 16)
    got = trace(model, v4_attention(0))
    assert got["attention_keys"].shape == (1, 1, len(PROMPT), 16)
    assert got["attention_keys"].data_ptr() == got["attention_values"].data_ptr()
    note = model.support(0).notes["self_attn.attention_values"]
    assert "one tensor passed as both key and value" in note


def test_v4_assigning_values_leaves_the_scores_and_an_in_place_edit_of_keys_reaches_values():
    model = tiny("deepseek_v4")
    clean = trace(model, v4_attention(0))
    with torch.no_grad(), model.trace(PROMPT):
        attn = model.layers[0].self_attn
        attn.attention_values = attn.attention_values * 2
        probs, heads = attn.attention_probabilities.save(), attn.attention_head_outputs.save()
    assert torch.allclose(probs, clean["attention_probabilities"], atol=1e-6)
    assert torch.allclose(heads, 2 * clean["attention_head_outputs"], atol=1e-5)
    with torch.no_grad(), model.trace(PROMPT):
        attn = model.layers[0].self_attn
        attn.attention_keys[:] = 0  # the same tensor as the values: both become zero
        probs, heads = attn.attention_probabilities.save(), attn.attention_head_outputs.save()
    assert torch.equal(heads, torch.zeros_like(heads))
    visible = probs[0, :, -1, -4:]  # all scores zero: the last query spreads evenly over its window
    assert torch.allclose(visible, visible[:, :1].expand_as(visible))


def test_v4_premix_is_the_grouped_projection_input_after_the_inverse_rotation():
    model = tiny("deepseek_v4")
    family, module = model.family, model.layers[0].self_attn._module
    got = trace(model, v4_attention(0))
    heads, premix = got["attention_head_outputs"], got["attention_premix"]
    assert premix.shape == (1, len(PROMPT), 64)
    assert not torch.allclose(heads.reshape(1, len(PROMPT), -1), premix, atol=1e-3)  # the rotation matters
    assert torch.allclose(family.identities.merge_heads(module, heads), premix, atol=1e-5)
    rope = model.config.qk_rope_head_dim  # only the trailing rotary channels of each head change
    assert torch.allclose(
        heads[..., :-rope].reshape(1, len(PROMPT), 4, -1), premix.view(1, len(PROMPT), 4, 16)[..., :-rope], atol=1e-6
    )


def test_v4_premix_edits_land_in_place_and_by_assignment():
    model = tiny("deepseek_v4")
    family, module = model.family, model.layers[0].self_attn._module
    with torch.no_grad(), model.trace(PROMPT):
        attn = model.layers[0].self_attn
        attn.attention_premix[:, :, :16] = 0  # head 0, through the flattened view
        edited, out = attn.attention_premix.save(), attn.attention_output.save()
    assert torch.equal(edited[..., :16], torch.zeros(1, len(PROMPT), 16))
    assert torch.allclose(out, family.identities.project_output(module, edited), atol=1e-6)
    with torch.no_grad(), model.trace(PROMPT):
        attn = model.layers[0].self_attn
        attn.attention_premix = torch.ones(1, len(PROMPT), 64)
        out = attn.attention_output.save()
    assert torch.allclose(out, family.identities.project_output(module, torch.ones(1, len(PROMPT), 64)), atol=1e-6)


def test_v4_residual_is_hyper_connection_streams():
    model = tiny("deepseek_v4")
    hc = model.config.hc_mult
    got = trace(
        model,
        lambda m: {
            "e": m.embeddings,
            "in": m.layers[0].layer_input,
            "a": m.layers[0].self_attn.attention_output,
            "mid": m.layers[0].layer_mid,
            "out": m.layers[0].layer_output,
        },
    )
    assert got["in"].shape == got["mid"].shape == got["out"].shape == (1, len(PROMPT), hc, 64)
    assert torch.equal(got["in"], got["e"][:, :, None].expand(-1, -1, hc, -1))
    assert not torch.allclose(got["mid"], got["in"] + got["a"][:, :, None], atol=1e-3)  # not a plain sum
    block = model.layers[0]._module
    with torch.no_grad():
        mixed = model.family.identities.residual_add(block, "attention", got["in"], got["a"])
    assert torch.allclose(mixed, got["mid"], atol=1e-5)
    notes = model.support(0).notes
    assert all("hyper-connection streams" in notes[k] for k in ("layer_input", "layer_mid", "layer_output"))


@pytest.mark.parametrize(
    ("layer", "kind", "entries"),
    [(1, "heavily_compressed_attention", 18 // 8), (2, "compressed_sparse_attention", 18 // 4)],
)
def test_v4_compressed_layers_report_their_longer_key_axis(layer, kind, entries):
    model = tiny("deepseek_v4")
    report = model.support(layer)
    for key in ("attention_keys", "attention_values", "attention_scores", "attention_probabilities", "attention_sinks"):
        assert kind in report[f"self_attn.{key}"] and "seq + seq // compress_rate" in report[f"self_attn.{key}"]
    for key in ("attention_queries", "attention_head_outputs", "attention_premix", "attention_output"):
        assert report[f"self_attn.{key}"] is None
    with pytest.raises(attnlens.Unavailable, match=kind):
        with model.trace(PROMPT):
            model.layers[layer].self_attn.attention_keys.save()
    # What the reason claims: the attention function receives the sliding keys plus the compressor's entries.
    with torch.no_grad(), model.trace(PROMPT):
        keys = model.layers[layer].self_attn.source.attention_interface_1.inputs[0][2].save()
        queries = model.layers[layer].self_attn.attention_queries.save()
    assert keys.shape == (1, 1, len(PROMPT) + entries, 16) and queries.shape == (1, 4, len(PROMPT), 16)
