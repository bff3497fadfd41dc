"""NemotronH (attnlens/families/nemotron_h.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import saved_for


def test_nemotron_h_blocks_serve_their_one_sublayer():
    model, saved = tiny("nemotron_h"), saved_for("nemotron_h")
    kinds = model.config.layers_block_type
    assert kinds == ["linear_attention", "moe", "full_attention", "mlp"]
    attention, mlp = model.support(2), model.support(3)
    assert attention["mlp.mlp_output"].startswith("layer 2 of Nemotron-H is an attention block: it has no MLP")
    assert mlp["self_attn.attention_output"].startswith("layer 3 of Nemotron-H is an MLP block: it has no attention")
    assert torch.equal(saved[(2, "layer_mid")], saved[(2, "layer_output")])
    assert torch.equal(saved[(3, "layer_mid")], saved[(3, "layer_input")])
    assert not hasattr(model.layers[3], "self_attn") and not hasattr(model.layers[2], "mlp")
