"""Every core family, every layer: the identities that pin each value to its place in the forward."""

import pytest
import torch

from conftest import CORE_FAMILIES, PROMPT, tiny
from identities import failures, read_everything

_saved = {}


def saved_for(family):
    if family not in _saved:
        _saved[family] = read_everything(tiny(family), PROMPT)
    return _saved[family]


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_identities_hold(family, layer):
    model = tiny(family)
    assert failures(model, saved_for(family), layer) == []


def test_model_values(family):
    model = tiny(family)
    saved = saved_for(family)
    inner = model._module
    with torch.no_grad():
        ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
        reference = inner(ids).logits
        assert torch.allclose(saved["logits"], reference, atol=1e-5)
        embed = inner.get_input_embeddings()
        assert torch.equal(saved["embeddings"], embed(ids))
        last = saved[(model.num_layers - 1, "layer_output")]
        final_norm = model.family.final_norm.split(".")
        module = inner
        for part in final_norm:
            module = getattr(module, part)
        assert torch.allclose(module(last), saved["final_norm_output"], atol=1e-6)


def test_grouped_heads_are_read_before_repetition():
    model = tiny("llama")
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
    saved = saved_for("llama")
    assert saved[(0, "attention_keys")].shape[1] == 2
    assert saved[(0, "attention_queries")].shape[1] == 4


def test_sliding_window_rows_are_zero_outside_the_window():
    # Gemma 2's layer 0 slides over 4 keys, layer 1 sees everything: a wrong window would pass neither check.
    saved = saved_for("gemma2")
    sliding, full = saved[(0, "attention_probabilities")], saved[(1, "attention_probabilities")]
    last = sliding[0, :, -1]
    assert (last[:, :-4] == 0).all() and (last[:, -4:] > 0).all()
    assert (full[0, :, -1] > 0).all()


def test_soft_capping_bounds_the_scores():
    model = tiny("gemma2")
    cap = model.config.attn_logit_softcapping
    scores = saved_for("gemma2")[(1, "attention_scores")]
    assert scores.max() <= cap and scores.max() > cap * 0.5  # the cap binds on these weights


@pytest.mark.parametrize("family", CORE_FAMILIES)
def test_a_miswired_family_fails_the_identities(family):
    """The identities must catch a value read from the wrong place: rewire three values and expect failures."""
    model = tiny(family)
    wrong = dict(model.family._locations)
    swaps = {"attention_scores": wrong["attention_probabilities"],
             "attention_keys": wrong["attention_values"],
             "layer_mid": wrong["layer_input"]}
    original = model.family.__dict__.get("_locations")
    model.family.__dict__["_locations"] = {**wrong, **swaps}
    try:
        bad = failures(model, read_everything(model, PROMPT), 1)
    finally:
        model.family.__dict__["_locations"] = original
    assert "softmax(scores) == probabilities" in bad
    assert "layer input + attention output == layer mid" in bad
    assert any("keys" in name or "score" in name for name in bad)
