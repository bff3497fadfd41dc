"""Cohere (attnlens/families/cohere.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, saved_for


def test_cohere_logits_are_scaled():
    model = tiny("cohere")
    scale = model.config.logit_scale
    assert scale != 1
    with torch.no_grad():
        expected = model._module.lm_head(saved_for("cohere")["final_norm_output"]) * scale
    assert close(saved_for("cohere")["logits"], expected)
    assert str(scale) in model.support(0).notes["logits"]
