"""Bloom (attnlens/families/bloom.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, read_everything, saved_for

import attnlens


def test_bloom_attention_output_is_the_projection_and_layer_mid_the_module_output():
    model = tiny("bloom")
    saved = saved_for("bloom")
    block = model.layers[1]._module
    v = {
        name: saved[(1, name)]
        for name in ("layer_input", "attention_premix", "attention_output", "layer_mid", "mlp_output", "layer_output")
    }
    with torch.no_grad():
        assert torch.equal(block.self_attention.dense(v["attention_premix"]), v["attention_output"])
    assert torch.equal(v["layer_input"] + v["attention_output"], v["layer_mid"])  # dropout_add, in eval
    assert torch.equal(v["layer_mid"] + v["mlp_output"], v["layer_output"])
    assert not close(v["attention_output"], v["layer_mid"])
    notes = model.support(1).notes
    assert "residual + this" in notes["self_attn.attention_output"] and "residual + this" in notes["mlp.mlp_output"]


def test_bloom_residual_after_the_norm():
    """apply_residual_connection_post_layernorm: the block adds to the norms' outputs; the notes say so."""
    model = tiny("bloom:post_norm_residual")
    saved = read_everything(model, PROMPT)
    v = {
        name: saved[(1, name)]
        for name in (
            "layer_input",
            "attention_norm_output",
            "attention_output",
            "layer_mid",
            "mlp_norm_output",
            "mlp_output",
            "layer_output",
        )
    }
    assert torch.equal(v["attention_norm_output"] + v["attention_output"], v["layer_mid"])
    assert torch.equal(v["mlp_norm_output"] + v["mlp_output"], v["layer_output"])
    assert not close(v["layer_input"] + v["attention_output"], v["layer_mid"])
    notes = model.support(1).notes
    assert notes["layer_mid"].startswith("apply_residual_connection_post_layernorm: attention_norm_output + ")
    assert notes["layer_output"].startswith("apply_residual_connection_post_layernorm: mlp_norm_output + ")
    assert "layer_mid" not in tiny("bloom").support(1).notes


def test_bloom_sliced_tensor_parallel_projections_are_unavailable():
    model = tiny("bloom", pretraining_tp=2, slow_but_exact=True)
    report = model.support(1)
    why = (
        "config.pretraining_tp=2 with slow_but_exact=True runs the {} as sliced F.linear calls, so `{}` is never "
        "called; load with slow_but_exact=False"
    )
    for key in ("self_attn.attention_premix", "self_attn.attention_output"):
        assert report[key] == why.format("output projection", "dense")
    for key in ("mlp.mlp_neurons", "mlp.mlp_output"):
        assert report[key] == why.format("MLP's down projection", "dense_4h_to_h")
    with pytest.raises(attnlens.Unavailable, match=r"sliced F\.linear"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].self_attn.attention_premix.save()
    assert report["self_attn.attention_head_outputs"] is None


def test_bloom_head_output_edit_moves_the_logits_as_recomputed_by_hand():
    """Head outputs are a view of the bmm's [batch*heads] mix: an in-place edit lands; recompute the last block."""
    model = tiny("bloom")
    last = model.num_layers - 1
    layer = model.layers[last]
    with torch.no_grad(), model.trace(PROMPT):
        layer_input = layer.layer_input.save()
        layer.self_attn.attention_head_outputs[:, :, 1] = 0
        premix = layer.self_attn.attention_premix.save()
        logits = model.logits.save()
    inner, block = model._module, layer._module
    assert (premix[..., 16:32] == 0).all() and (premix[..., :16] != 0).all()
    with torch.no_grad():
        mid = layer_input + block.self_attention.dense(premix)
        out = block.mlp(block.post_attention_layernorm(mid), mid)
        by_hand = inner.lm_head(inner.transformer.ln_f(out))
    assert close(logits, by_hand) and not close(logits, saved_for("bloom")["logits"])
