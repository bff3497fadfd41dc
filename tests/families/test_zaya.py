"""Zaya (attnlens/families/zaya.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, needs, tiny
from identities import perturbed, replaced, trace

from attnlens.checks import failures, read_everything

ZAYA_SCALES = {"hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"}


def test_zaya_affine_residual_adds_and_the_router_state():
    needs("zaya")
    model = perturbed("zaya", ZAYA_SCALES)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    with replaced(model.family, residual_add=lambda block, sublayer, stream, update, **arguments: stream + update):
        # a plain sum misses the learned scales
        assert all("layer input + attention output == layer mid" in failures(model, saved, i) for i in range(3))
    for i in (1, 2):  # the router adds the state the previous block hands on: without it, other experts win
        mlp = model._module.model.layers[i].mlp
        assert saved[(i, "block_arguments")]["router_state"] is not None
        with torch.no_grad():
            alone = mlp(saved[(i, "mlp_input")])[0]
        assert not torch.allclose(alone, saved[(i, "mlp_output")], atol=1e-4)
    assert saved[(0, "block_arguments")]["router_state"] is None


def test_zaya_sliding_layers():
    needs("zaya")
    model = tiny("zaya")
    got = trace(model, lambda m: {i: m.layers[i].self_attn.attention_probabilities for i in (0, 1)})
    last = got[0][0, :, -1]
    assert (last[:, :-4] == 0).all() and (last[:, -4:] > 0).all()
    assert (got[1][0, :, -1] > 0).all()
    assert (
        model.family.score_function().sliding_window(model.config, 0) == 4
        and model.family.score_function().sliding_window(model.config, 1) is None
    )
