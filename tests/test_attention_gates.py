"""Output gates recomputed from the gate projection (AFMoE, Laguna).

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import tiny
from identities import close, saved_for


@pytest.mark.parametrize("case", ["afmoe", "laguna", "laguna:per_element_gate"])
def test_gates_are_recomputed_from_the_gate_projection(case):
    model, saved = tiny(case), saved_for(case)
    module = model.layers[1].self_attn._module
    x = saved[(1, "attention_norm_output")]
    with torch.no_grad():
        if case == "afmoe":
            expected = torch.sigmoid(module.gate_proj(x)).unflatten(-1, (-1, module.head_dim))
        else:
            gate = torch.nn.functional.softplus(module.g_proj(x))
            expected = (
                gate[..., None].expand(-1, -1, -1, module.head_dim)
                if module.gate_per_head
                else gate.unflatten(-1, (-1, module.head_dim))
            )
    assert close(saved[(1, "attention_gate")], expected)
    if case.startswith("laguna"):
        assert model.layers[1].self_attn.num_heads == 8  # num_attention_heads_per_layer
