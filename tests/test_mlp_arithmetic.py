"""The MLP's arithmetic (`Identities.mlp_arithmetic`) on the families whose MLP is not `down_proj(act_fn(gate_proj(x)) *
up_proj(x))`.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, failures_with, mlp_of, swapped


def _halves(projected):
    return projected.chunk(2, dim=-1)


#: case -> (a layer serving the MLP values, the MLP's output from its input and a (possibly edited) activation, written
#: from transformers' source independently of the family, and the output from the neurons).
BY_HAND = {
    "bitnet": (1, lambda m, x, a: m.down_proj(m.ffn_sub_norm(a * m.up_proj(x))), lambda m, n: m.down_proj(n)),
    "lfm2": (1, lambda m, x, a: m.w2(a * m.w3(x)), lambda m, n: m.w2(n)),
    "lfm2_moe": (0, lambda m, x, a: m.w2(a * m.w3(x)), lambda m, n: m.w2(n)),  # layer 0 is dense
    "lfm3": (1, lambda m, x, a: m.w2(a * m.w3(x)), lambda m, n: m.w2(n)),
    "granitemoehybrid:dense": (
        1,
        lambda m, x, a: m.output_linear(a * _halves(m.input_linear(x))[1]),
        lambda m, n: m.output_linear(n),
    ),
    "moshi": (1, lambda m, x, a: m.fc2(a * m.fc1(x).view(*x.shape[:2], 2, -1)[..., 1, :]), lambda m, n: m.fc2(n)),
    "modernbert-decoder": (1, lambda m, x, a: m.Wo(a * _halves(m.Wi(x))[1]), lambda m, n: m.Wo(n)),
    "falcon_h1": (
        1,
        lambda m, x, a: m.down_proj(m.up_proj(x) * a) * m.down_multiplier,
        lambda m, n: m.down_proj(n) * m.down_multiplier,
    ),
}


#: case -> the activation's input from the MLP's input, by hand.
ACTIVATION_INPUT = {
    "bitnet": lambda m, x: m.gate_proj(x),
    "lfm2": lambda m, x: m.w1(x),
    "lfm2_moe": lambda m, x: m.w1(x),
    "lfm3": lambda m, x: m.w1(x),
    "granitemoehybrid:dense": lambda m, x: _halves(m.input_linear(x))[0],
    "moshi": lambda m, x: m.fc1(x).view(*x.shape[:2], 2, -1)[..., 0, :],
    "modernbert-decoder": lambda m, x: _halves(m.Wi(x))[0],
    "falcon_h1": lambda m, x: m.gate_proj(x) * m.gate_multiplier,
}


@pytest.mark.parametrize("case", BY_HAND)
def test_activation_and_neurons_are_served_and_match_the_source(case):
    model = tiny(case)
    layer, by_hand, _ = BY_HAND[case]
    report = model.support(layer)
    assert report["mlp.mlp_activation"] is None and report["mlp.mlp_neurons"] is None
    mlp = mlp_of(model, layer)
    with torch.no_grad(), model.trace(PROMPT):
        x = model.layers[layer].mlp_input.save()
        activation = model.layers[layer].mlp.mlp_activation.save()
        neurons = model.layers[layer].mlp.mlp_neurons.save()
        output = model.layers[layer].mlp.mlp_output.save()
    with torch.no_grad():
        act = model.family.identities.mlp_arithmetic(mlp).act
        assert activation.shape == neurons.shape == (1, len(PROMPT), neurons.shape[-1])
        assert close(act(ACTIVATION_INPUT[case](mlp, x)), activation)
        assert close(by_hand(mlp, x, activation), output)
        assert not close(activation, neurons, atol=1e-3)  # the product (and any norm) binds: two different tensors


@pytest.mark.parametrize("case", BY_HAND)
@pytest.mark.parametrize("value", ["mlp_activation", "mlp_neurons"])
def test_an_edit_moves_the_output_as_the_arithmetic_predicts(case, value):
    """Scale the value by a random factor per entry: the MLP's output is then what the source computes from the
    edited value, by hand and by the family's arithmetic; and the edit moved it."""
    model = tiny(case)
    layer, by_hand, from_neurons = BY_HAND[case]
    mlp = mlp_of(model, layer)
    torch.manual_seed(0)
    with torch.no_grad(), model.trace(PROMPT):
        x = model.layers[layer].mlp_input.save()
        envoy = model.layers[layer].mlp
        original = getattr(envoy, value).save()
        edited = (original * (1 + torch.rand_like(original))).save()
        setattr(envoy, value, edited)
        output = envoy.mlp_output.save()
    arithmetic = model.family.identities.mlp_arithmetic(mlp)
    with torch.no_grad():
        if value == "mlp_activation":
            expected = by_hand(mlp, x, edited)
            assert close(arithmetic.output(arithmetic.neurons(x, edited)), expected)
            unedited = by_hand(mlp, x, original)
        else:
            expected = from_neurons(mlp, edited)
            assert close(arithmetic.output(edited), expected)
            unedited = from_neurons(mlp, original)
    assert close(output, expected)
    assert not close(output, unedited, atol=1e-3)


@pytest.mark.parametrize("case", BY_HAND)
@pytest.mark.parametrize(("value", "other"), [("mlp_activation", "mlp_neurons"), ("mlp_neurons", "mlp_activation")])
def test_a_miswired_mlp_value_fails_a_named_identity(case, value, other):
    model = tiny(case)
    layer = BY_HAND[case][0]
    bad = failures_with(model, {"locations_for": swapped(model.family.locations_for, layer, value, other)}, layer)
    assert any("activation" in name or "neurons" in name for name in bad), bad


@pytest.mark.parametrize("case", ["lfm2", "moshi"])
def test_an_in_place_edit_of_the_activation_lands(case):
    """LFM2's activation is an operation's output (an inline F.silu), Moshi's a module's: zeroing half the neurons'
    activations in place moves the output as the source predicts."""
    model = tiny(case)
    layer, by_hand, _ = BY_HAND[case]
    mlp = mlp_of(model, layer)
    with torch.no_grad(), model.trace(PROMPT):
        x = model.layers[layer].mlp_input.save()
        activation = model.layers[layer].mlp.mlp_activation
        activation[..., ::2] = 0
        edited = activation.save()
        output = model.layers[layer].mlp.mlp_output.save()
    assert (edited[..., ::2] == 0).all() and (edited[..., 1::2] != 0).any()
    with torch.no_grad():
        assert close(output, by_hand(mlp, x, edited))
