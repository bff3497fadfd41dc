"""Starcoder2 (attnlens/families/starcoder2.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, tiny
from identities import close, saved_for


def test_starcoder2_plain_mlp():
    model = tiny("starcoder2")
    saved = saved_for("starcoder2")
    mlp = model.layers[1]._module.mlp
    with torch.no_grad():
        assert close(mlp.act(mlp.c_fc(saved[(1, "mlp_input")])), saved[(1, "mlp_activation")])


def test_starcoder2_outputs_are_after_the_residual_dropout():
    model = tiny("starcoder2", residual_dropout=0.5)  # its own model: this test trains it
    p = model.config.residual_dropout
    model._module.train()
    try:
        with torch.no_grad(), model.trace(PROMPT):
            premix = model.layers[1].self_attn.attention_premix.save()
            out = model.layers[1].self_attn.attention_output.save()
    finally:
        model._module.eval()
    projected = model.layers[1]._module.self_attn.o_proj(premix).detach()
    dropped = out == 0
    assert 0.2 < dropped.float().mean() < 0.8  # dropout acted on the read value
    assert close(out[~dropped], projected[~dropped] / (1 - p))
    assert "residual dropout" in model.support(1).notes["self_attn.attention_output"]
