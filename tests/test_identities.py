"""Every family and layout, every layer: the identities that pin each value to its place in the forward."""

import pytest
import torch
from conftest import ALL_CASES, PROMPT, tiny
from identities import failures, read_everything, saved_for, swapped

import attnlens
from attnlens import verification

#: Values every family must serve on at least one layer: a family that declared them away would pass the identities.
ESSENTIAL = (
    "layer_input",
    "self_attn.attention_queries",
    "self_attn.attention_keys",
    "self_attn.attention_values",
    "self_attn.attention_probabilities",
    "self_attn.attention_head_outputs",
    "self_attn.attention_premix",
    "self_attn.attention_output",
    "layer_output",
    "logits",
)


@pytest.mark.parametrize("case", ALL_CASES)
def test_identities_hold(case):
    model = tiny(case)
    saved = saved_for(case)
    bad = {layer: failures(model, saved, layer) for layer in range(model.num_layers)}
    assert {layer: names for layer, names in bad.items() if names} == {}
    served = [[key for key in ESSENTIAL if model.support(layer)[key] is None] for layer in range(model.num_layers)]
    assert max(served, key=len) == list(ESSENTIAL)


#: Built-in layouts the load-time verification would refuse (`verify=True`), and why: their values depart from
#: docs/values.md's layouts in ways their notes say.
VERIFY_REFUSES = {
    "zamba": "the shared block's attention norm reads the stream and the embeddings concatenated (2 x hidden wide)",
    "zamba2": "the same",
    "zamba2:plain": "the same",
}


@pytest.mark.parametrize("case", ALL_CASES)
def test_the_load_time_verification_holds_on_every_built_in_layout(case):
    """`verify=True` on a built-in family: the verification a user family gets at load (attnlens/verification.py)
    finds nothing wrong with a family the identities above hold for: no false refusal."""
    if case in VERIFY_REFUSES:
        with pytest.raises(attnlens.Miswired, match="attention_norm_output layout"):
            verification.verify(tiny(case))
        return
    verification.verify(tiny(case))


@pytest.mark.parametrize("case", ALL_CASES)
def test_model_values(case):
    family = case
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
        last = model.family.identities.residual_read(inner, "final", last)  # collapses hyper-connection streams
        if "final_norm_output" in saved:  # OPT's post-norm layout and GPT-1 have none
            module = inner.get_submodule(model.family.final_norm)
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


#: Rewirings that must be caught: value -> the value whose location it is given, and words a failing check names.
MISWIRINGS = {
    "attention_scores": ("attention_probabilities", ("scores", "softmax")),
    "attention_keys": ("attention_values", ("keys", "score")),
    "layer_mid": ("layer_input", ("layer mid",)),
    "attention_head_outputs": ("attention_premix", ("head outputs",)),
}


@pytest.mark.parametrize("case", ALL_CASES)
@pytest.mark.parametrize("value", list(MISWIRINGS))
def test_a_miswired_family_fails_the_identities(case, value):
    """The identities must catch a value read from the wrong place: rewire it and expect a named failure."""
    model = tiny(case)
    layer = next(i for i in range(model.num_layers) if model.support(i)["self_attn.attention_probabilities"] is None)
    locations = model.family.locations_for(model.config, layer)
    other, words = MISWIRINGS[value]
    if value not in locations or other not in locations:
        pytest.skip(f"{case} has no {value} or {other} at layer {layer}")
    saved = saved_for(case)
    if saved[(layer, value)].shape == saved[(layer, other)].shape and torch.equal(
        saved[(layer, value)], saved[(layer, other)]
    ):  # DeepSeek-V4's keys are its values
        pytest.skip(f"{case}'s {value} and {other} are one tensor at layer {layer}: reading one for the other is right")
    family = model.family
    family.locations_for = swapped(family.locations_for, layer, value, other)
    model.access.refresh()
    try:
        bad = failures(model, read_everything(model, PROMPT), layer)
    finally:
        del family.locations_for
        model.access.refresh()
    assert any(word in name for name in bad for word in words), bad
