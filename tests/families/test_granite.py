"""Granite (attnlens/families/granite.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, failures, replaced, saved_for


def test_granite_scores_use_the_attention_multiplier():
    model = tiny("granite")
    saved = saved_for("granite")
    attn = model.layers[1].self_attn
    assert attn.scale == model.config.attention_multiplier != attn.head_dim**-0.5
    q, k = saved[(1, "attention_queries")], saved[(1, "attention_keys")]
    by_hand = q @ k.repeat_interleave(2, dim=1).transpose(2, 3) * model.config.attention_multiplier
    length = q.shape[2]
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    by_hand = by_hand.masked_fill(future, torch.finfo(q.dtype).min)
    assert close(by_hand, saved[(1, "attention_scores")])


def test_granite_residual_embedding_and_logit_multipliers():
    model = tiny("granite")
    config = model.config
    saved = saved_for("granite")
    r = config.residual_multiplier
    for i in range(model.num_layers):
        assert close(saved[(i, "layer_input")] + r * saved[(i, "attention_output")], saved[(i, "layer_mid")])
        assert close(saved[(i, "layer_mid")] + r * saved[(i, "mlp_output")], saved[(i, "layer_output")])
        assert not close(saved[(i, "layer_input")] + saved[(i, "attention_output")], saved[(i, "layer_mid")])
    assert close(saved[(0, "layer_input")], saved["embeddings"] * config.embedding_multiplier)
    with torch.no_grad():
        head = model._module.lm_head(saved["final_norm_output"])
    assert close(saved["logits"], head / config.logits_scaling)
    notes = model.support(0).notes
    assert "residual_multiplier (0.5)" in notes["layer_mid"] and "logits_scaling (4)" in notes["logits"]
    assert "embedding_multiplier" in notes["embeddings"]


def test_granite_identities_need_the_residual_hook():
    """The shared identities use `Identities.residual_add`; without Granite's multiplier they must fail."""
    model = tiny("granite")
    with replaced(model.family, residual_add=lambda block, sublayer, stream, update: stream + update):
        bad = failures(model, saved_for("granite"), 1)
    assert "layer input + attention output == layer mid" in bad and "layer mid + mlp output == layer output" in bad
    assert failures(model, saved_for("granite"), 1) == []
