"""DistilBERT and MPNet as encoders (`families/distilbert.py`, `families/mpnet.py`): their patterns, block outputs and
logits against transformers' own, a padded batch, a head ablated by hand, and MPNet's relative position bias: what the
encoder computes, the same in every block, and an edit of one block's bias moving its scores and the logits as a hook
on transformers' own call predicts."""

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.registry import family_for

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128)
PROMPT = "Hello world"
TYPES = ("distilbert", "mpnet")


def encoder(model_type: str) -> attnlens.StandardizedEncoder:
    """The type's masked LM, tiny, eager, wide weights (as tests/test_encoders.py builds it)."""
    config = transformers.AutoConfig.for_model(
        model_type, **SIZES, pad_token_id=0, **family_for(model_type).tiny.kwargs
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    inner = getattr(transformers, modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES[model_type])(config).eval()
    inner = attnlens.models._perturbed(inner)
    return attnlens.StandardizedEncoder(inner, tokenizer=attnlens.models.char_tokenizer())


def ids(model, prompt=PROMPT):
    return model.tokenizer(prompt, return_tensors="pt").input_ids


@pytest.mark.parametrize("model_type", TYPES)
def test_values_equal_transformers_and_hold_every_identity(model_type):
    model = encoder(model_type)
    assert type(model.family).__name__ == {"distilbert": "DistilBert", "mpnet": "MPNet"}[model_type]
    assert not model.family.score_function().causal(model.config)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(2)] == [[], []]
    with torch.no_grad():
        reference = model._module(ids(model), output_attentions=True, output_hidden_states=True)
    for layer in range(2):
        pattern = saved[(layer, "attention_probabilities")]
        assert torch.equal(pattern, reference.attentions[layer])
        assert (pattern[..., :1, 1:] > 0).all(), "bidirectional: the first query sees the later keys"
        assert torch.equal(saved[(layer, "layer_output")], reference.hidden_states[layer + 1])
    assert torch.equal(saved["logits"], reference.logits)


@pytest.mark.parametrize("model_type", TYPES)
def test_padding_is_masked_and_real_rows_equal_transformers(model_type):
    model = encoder(model_type)
    prompts = ["Hello world", "Hi"]
    batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad(), model.trace(prompts):
        attention = model.layers[1].self_attn
        scores, pattern = attention.attention_scores.save(), attention.attention_probabilities.save()
    with torch.no_grad():
        expected = model._module(**batch, output_attentions=True).attentions[1]
    keys = batch.attention_mask.bool()
    real = (keys[:, None, :, None] & keys[:, None, None, :]).expand_as(pattern)
    assert torch.allclose(pattern[real], expected[real], atol=1e-6)
    assert (pattern.masked_select(~keys[:, None, None, :].expand_as(pattern)) == 0).all()
    assert torch.allclose(scores.softmax(-1), pattern, atol=1e-6)


#: The module each type's head outputs are merged for, before its output projection.
OUTPUT_PROJECTION = {
    "distilbert": "distilbert.transformer.layer.0.attention.out_lin",
    "mpnet": "mpnet.encoder.layer.0.attention.attn.o",
}


@pytest.mark.parametrize("model_type", TYPES)
def test_a_head_ablated_moves_the_logits_as_a_hook_on_the_output_projection_does(model_type):
    model = encoder(model_type)
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[0].self_attn.attention_head_outputs[:, :, 2] = 0
        logits = model.logits.save()

    def zero_head(module, args):
        merged = args[0].clone()
        merged.view(*merged.shape[:2], 4, 16)[:, :, 2] = 0
        return (merged,)

    inner = model._module
    handle = inner.get_submodule(OUTPUT_PROJECTION[model_type]).register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            expected = inner(ids(model)).logits
    finally:
        handle.remove()
    assert torch.allclose(logits, expected, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(logits, inner(ids(model)).logits, atol=1e-3)


@pytest.mark.parametrize("model_type", TYPES)
def test_support_says_what_the_encoder_is(model_type):
    report = encoder(model_type).support(0)
    assert report.notes["self_attn.attention_probabilities"].startswith("bidirectional")
    assert "normalises after each residual add" in report["attention_norm_output"]
    assert "keeps no KV cache" in report["self_attn.attention_cache_keys"]
    assert "no final norm" in report["final_norm_output"]
    if model_type == "distilbert":
        assert report["self_attn.attention_position_bias"].startswith("no position bias")
    else:
        assert report["self_attn.attention_position_bias"] is None
        assert "T5's bidirectional buckets" in report.notes["self_attn.attention_position_bias"]


# --- MPNet's relative position bias ------------------------------------------------------------------------------


def mpnet_reads(model, prompt=PROMPT, edit=None):
    """Every layer's bias, queries, keys and scores, the logits; on layer 1 `edit(its self_attn)` first."""
    found = {}
    with torch.no_grad(), model.trace(prompt):
        for layer in range(2):
            attention = model.layers[layer].self_attn
            if edit is not None and layer == 1:
                edit(attention)
            found[layer] = [
                attention.attention_position_bias.save(),
                attention.attention_queries.save(),
                attention.attention_keys.save(),
                attention.attention_scores.save(),
            ]
        found["logits"] = model.logits.save()
    return found


def test_mpnet_bias_is_the_encoders_and_the_same_in_every_block():
    model = encoder("mpnet")
    found = mpnet_reads(model)
    inner = model._module.mpnet
    with torch.no_grad():
        hidden = inner.embeddings(input_ids=ids(model))
        expected = inner.encoder.compute_position_bias(hidden)
    assert expected.shape == (1, 4, len(PROMPT), len(PROMPT))
    for layer in range(2):
        bias, queries, keys, scores = found[layer]
        assert torch.equal(bias, expected)
        assert torch.allclose(scores, queries @ keys.transpose(-1, -2) / 16**0.5 + bias, atol=1e-6)
        assert not torch.allclose(scores, queries @ keys.transpose(-1, -2) / 16**0.5, atol=1e-2), "the bias counts"
    # relative: along each diagonal (one key-query distance) the bias is one number per head
    assert torch.equal(expected[0, :, 1, 0], expected[0, :, 5, 4])
    assert not torch.equal(expected[0, :, 1, 0], expected[0, :, 0, 1]), "bidirectional buckets: sign matters"


def test_mpnet_edit_of_one_blocks_bias_moves_its_scores_and_the_logits_as_a_hook_predicts():
    model = encoder("mpnet")
    plain = mpnet_reads(model)
    torch.manual_seed(1)
    delta = torch.randn(1, 4, len(PROMPT), len(PROMPT))

    def edit(attention):
        attention.attention_position_bias = attention.attention_position_bias + delta

    edited = mpnet_reads(model, edit=edit)
    assert torch.equal(edited[0][0], plain[0][0]) and torch.equal(edited[0][3], plain[0][3]), "layer 0 untouched"
    bias, queries, keys, scores = edited[1]
    assert torch.allclose(bias, plain[1][0] + delta)
    assert torch.allclose(scores, queries @ keys.transpose(-1, -2) / 16**0.5 + plain[1][0] + delta, atol=1e-5)

    def shifted(module, args, kwargs):  # transformers' own call of layer 1's attention, its bias argument moved
        return (args[0], args[1], args[2] + delta), kwargs

    inner = model._module
    handle = inner.mpnet.encoder.layer[1].attention.attn.register_forward_pre_hook(shifted, with_kwargs=True)
    try:
        with torch.no_grad():
            expected = inner(ids(model)).logits
    finally:
        handle.remove()
    assert torch.allclose(edited["logits"], expected, atol=1e-5)
    assert not torch.allclose(edited["logits"], plain["logits"], atol=1e-3)


def test_mpnet_bias_edited_in_place_is_refused_and_reaches_no_block():
    """Every block receives the encoder's one tensor: the value is a copy, and an in-place edit of it says to assign."""
    model = encoder("mpnet")
    plain = mpnet_reads(model)
    with pytest.raises(attnlens.EditError, match="assign it"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[0].self_attn.attention_position_bias[:] = 0
            model.layers[1].self_attn.attention_queries.save()
    assert torch.equal(mpnet_reads(model)["logits"], plain["logits"])
