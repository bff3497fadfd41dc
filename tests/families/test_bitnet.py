"""BitNet (attnlens/families/bitnet.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, tiny
from identities import close, failures, read_everything, saved_for

from attnlens.family import Family


def _failures_with(model, replaced, layer):
    """The identities of `layer` with the family's methods or locations replaced for one run."""
    family = model.family
    for name, value in replaced.items():
        setattr(family, name, value)
    model.access.refresh()
    try:
        return failures(model, read_everything(model, PROMPT), layer)
    finally:
        for name in replaced:
            delattr(family, name)
        model.access.refresh()


def test_bitnet_without_the_sub_norm_fails_the_product():
    model = tiny("bitnet")
    bad = _failures_with(model, {"mlp_arithmetic": lambda mlp: Family.mlp_arithmetic(model.family, mlp)}, 1)
    assert bad == ["activation * up(mlp input) == neurons"], bad


def merged(heads):
    return heads.reshape(*heads.shape[:2], -1)


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
