"""Lfm3 (attnlens/families/lfm3.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, saved_for


def test_lfm3_gate_is_one_sigmoid_per_head():
    model, saved = tiny("lfm3"), saved_for("lfm3")
    module = model.layers[1].self_attn._module
    with torch.no_grad():
        gate = torch.sigmoid(module.g_proj(saved[(1, "attention_norm_output")]))
    assert close(saved[(1, "attention_gate")], gate[..., None].expand(-1, -1, -1, module.head_dim))
    assert model.support(0)["self_attn.attention_gate"].startswith("layer 0 of Lfm3 is a short gated convolution")
