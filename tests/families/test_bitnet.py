"""BitNet (attnlens/families/bitnet.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, failures_with, merged, saved_for

from attnlens.family import Family


def test_bitnet_without_the_sub_norm_fails_the_product():
    model = tiny("bitnet")
    bad = failures_with(model, {"mlp_arithmetic": lambda mlp: Family.Identities(model.family).mlp_arithmetic(mlp)}, 1)
    assert bad == ["activation * up(mlp input) == neurons"], bad


def test_bitnet_premix_is_what_the_sub_norm_receives():
    model, saved = tiny("bitnet"), saved_for("bitnet")
    module = model.layers[0].self_attn._module
    with torch.no_grad():
        premix = saved[(0, "attention_premix")]
        assert close(premix, merged(saved[(0, "attention_head_outputs")]))
        assert close(module.o_proj(module.attn_sub_norm(premix)), saved[(0, "attention_output")])
        assert not close(module.o_proj(premix), saved[(0, "attention_output")], atol=1e-3)
    assert model.support(0)["mlp.mlp_activation"] is None  # the MLP's sub-norm: tests/test_mlp_arithmetic.py
    assert "ffn_sub_norm" in model.support(0).notes["mlp.mlp_neurons"]
