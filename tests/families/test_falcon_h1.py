"""FalconH1 (attnlens/families/falcon_h1.py): what the shared identities cannot see."""

import dataclasses

import torch
from conftest import PROMPT, tiny
from identities import close, failures_with, mlp_of, saved_for

from attnlens.family import Family


def test_falcon_h1_multipliers_bind_and_the_common_arithmetic_fails_on_them():
    model = tiny("falcon_h1")
    assert tuple(model.config.mlp_multipliers) == (2.0, 0.5)
    bad = failures_with(model, {"mlp_arithmetic": lambda mlp: Family.Identities(model.family).mlp_arithmetic(mlp)}, 1)
    assert {"activation == act(gate(mlp input))", "down projection(neurons) == mlp output"} <= set(bad), bad
    assert "mlp.mlp_output" in model.support(1).notes and "0.5" in model.support(1).notes["mlp.mlp_output"]


def test_identity_names_say_the_familys_arithmetic():
    model = tiny("falcon_h1")
    arithmetic = model.family.identities.mlp_arithmetic(mlp_of(model, 0))
    wrong = dataclasses.replace(arithmetic, output=lambda neurons: arithmetic.output(neurons) * 2)
    bad = failures_with(model, {"mlp_arithmetic": lambda mlp: wrong}, 0)
    assert bad == ["down projection(neurons) * down_multiplier == mlp output"], bad


def test_falcon_h1_layer_mid_holds_the_mamba_branch():
    model, saved = tiny("falcon_h1"), saved_for("falcon_h1")
    config = model.config
    with torch.no_grad(), model.trace(PROMPT):
        mamba = model.layers[1].mamba.output.save()
    expected = (
        saved[(1, "layer_input")]
        + config.attention_out_multiplier * saved[(1, "attention_output")]
        + config.ssm_out_multiplier * mamba
    )
    assert close(expected, saved[(1, "layer_mid")])
    assert "times key_multiplier (0.5)" in model.support(1).notes["self_attn.attention_keys"]
