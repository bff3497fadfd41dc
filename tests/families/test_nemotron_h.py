"""NemotronH (attnlens/families/nemotron_h.py): what the shared identities cannot see."""

import re

import pytest
import torch
from conftest import tiny
from identities import saved_for

import attnlens


def test_nemotron_h_blocks_serve_their_one_sublayer():
    model, saved = tiny("nemotron_h"), saved_for("nemotron_h")
    kinds = model.config.layers_block_type
    assert kinds == ["linear_attention", "moe", "full_attention", "mlp"]
    attention, mlp = model.support(2), model.support(3)
    assert attention["mlp.mlp_output"].startswith("layer 2 of Nemotron-H is an attention block: it has no MLP")
    assert mlp["self_attn.attention_output"].startswith("layer 3 of Nemotron-H is an MLP block: it has no attention")
    assert torch.equal(saved[(2, "layer_mid")], saved[(2, "layer_output")])
    assert torch.equal(saved[(3, "layer_mid")], saved[(3, "layer_input")])
    for layer, key in ((3, "self_attn.attention_output"), (2, "mlp.mlp_output")):  # no such module: still the reason
        sublayer, name = key.split(".")
        with pytest.raises(attnlens.Unavailable, match=re.escape(model.support(layer)[key])):
            getattr(getattr(model.layers[layer], sublayer), name)
