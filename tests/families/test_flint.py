"""Flint (attnlens/families/flint.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, saved_for


def test_flint_sinks_are_the_dropped_softmax_column():
    model, saved = tiny("flint"), saved_for("flint")
    module = model.layers[1].self_attn._module
    scores = saved[(1, "attention_scores")]
    with_sink = torch.cat([scores, module.sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1).softmax(-1)
    assert close(saved[(1, "attention_sinks")], with_sink[..., -1])
    assert close(saved[(1, "attention_probabilities")], with_sink[..., :-1])
