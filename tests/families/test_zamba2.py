"""Zamba2 (attnlens/families/zamba2.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, saved_for, shared

#: case -> (hybrid layers, Mamba layers)
CASES = {"zamba": ((2, 3), (0, 1, 4)), "zamba2": ((1, 3, 4), (0, 2)), "zamba2:plain": ((1, 3, 4), (0, 2))}


def test_zamba2_cycles_its_weight_sets():
    model = tiny("zamba2")  # hybrid layers 1, 3, 4 with two weight sets: 1 and 4 share one
    assert shared(model, 1).self_attn.q_proj.weight is shared(model, 4).self_attn.q_proj.weight
    assert shared(model, 1).self_attn.q_proj.weight is not shared(model, 3).self_attn.q_proj.weight
    assert "[1, 4]" in model.support(4).notes["self_attn.attention_output"]


def heads(x, module):
    return x.view(*x.shape[:2], -1, module.head_dim).transpose(1, 2)


def test_zamba2_values_carry_each_layers_adapter():
    model, saved = tiny("zamba2"), saved_for("zamba2")
    for index, layer in enumerate(CASES["zamba2"][0]):
        attn = shared(model, layer).self_attn
        x = saved[(layer, "attention_norm_output")]
        with torch.no_grad():
            adapted = heads(attn.v_proj(x) + attn.linear_v_adapter_list[index](x), attn)
            plain = heads(attn.v_proj(x), attn)
        assert close(adapted, saved[(layer, "attention_values")])
        assert not close(plain, saved[(layer, "attention_values")], atol=1e-3)
        assert "adapter" in model.support(layer).notes["self_attn.attention_values"]
        assert "rotated" in model.support(layer).notes["self_attn.attention_queries"]


def test_zamba2_plain_queries_are_the_projection():
    model, saved = tiny("zamba2:plain"), saved_for("zamba2:plain")
    layer = 3
    attn = shared(model, layer).self_attn
    with torch.no_grad():
        queries = heads(attn.q_proj(saved[(layer, "attention_norm_output")]), attn)
    assert close(queries, saved[(layer, "attention_queries")])
    assert saved[(layer, "attention_keys")].shape[1] == 2  # grouped heads where there are no adapters
    assert "nothing is rotated" in model.support(layer).notes["self_attn.attention_queries"]
