"""Parallel blocks (GPT-J, Phi, Cohere, StableLM, GPT-NeoX): no layer_mid, and the shared norm as the MLP's norm output.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import LAYER, at, close

import attnlens

#: Parallel blocks where attention and the MLP read one norm output -> that norm.
SHARED_NORM = {
    "gptj": "ln_1",
    "phi": "input_layernorm",
    "phi:qk_layernorm": "input_layernorm",
    "cohere": "input_layernorm",
    "cohere:qk_norm": "input_layernorm",
    "stablelm:parallel": "input_layernorm",
}


PARALLEL = (*SHARED_NORM, "gpt_neox")


@pytest.mark.parametrize("case", PARALLEL)
def test_parallel_block_has_no_layer_mid(case):
    model = tiny(case)
    reason = model.support(LAYER)["layer_mid"]
    assert reason.startswith("a parallel block: attention and the MLP both read the block input")
    assert "no residual stream exists between attention and the MLP" in reason
    with pytest.raises(attnlens.Unavailable, match="a parallel block"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[LAYER].layer_mid.save()


@pytest.mark.parametrize("case", list(SHARED_NORM))
def test_shared_norm_is_the_mlp_norm_output(case):
    """mlp_norm_output is the one norm output both sublayers read, served where the MLP reads it (after attention)."""
    model = tiny(case)
    block = model.layers[LAYER]._module
    norm_output = at(case, "mlp_norm_output")
    assert torch.equal(norm_output, at(case, "attention_norm_output"))
    assert close(getattr(block, SHARED_NORM[case])(at(case, "layer_input")), norm_output)
    order = model.order(LAYER)
    assert order["mlp_norm_output"] == order["mlp_input"] > order["self_attn.attention_output"]
    assert (
        model.support(LAYER)
        .notes["mlp_norm_output"]
        .startswith(f"a parallel block: attention and the MLP read the same {SHARED_NORM[case]} output")
    )


@pytest.mark.parametrize("case", ["gptj", "phi", "cohere", "stablelm:parallel"])
def test_assigning_the_shared_norm_output_changes_only_the_mlp(case):
    model = tiny(case)
    layer = model.layers[LAYER]
    with torch.no_grad(), model.trace(PROMPT):
        layer_input = layer.layer_input.save()
        attention = layer.self_attn.attention_output.save()
        layer.mlp_norm_output = torch.zeros_like(layer.mlp_norm_output)
        mlp = layer.mlp.mlp_output.save()
        out = layer.layer_output.save()
    family, block = model.family, layer._module
    assert torch.equal(attention, at(case, "attention_output"))  # attention read the norm output before the edit
    with torch.no_grad():
        expected = family.identities.mlp_forward(family.identities.mlp_module(block), torch.zeros_like(layer_input))
    assert close(mlp, expected) and not close(mlp, at(case, "mlp_output"))
    assert close(out, layer_input + attention + mlp)
