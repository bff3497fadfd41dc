"""MiMoV2Flash (attnlens/families/mimo_v2_flash.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import trace

import attnlens


def test_mimo_sinks_and_doubled_kv_heads_only_on_sliding_layers():
    model = tiny("mimo_v2_flash")
    sliding, full = model.layers[0].self_attn, model.layers[1].self_attn
    assert (sliding.num_kv_heads, full.num_kv_heads) == (4, 2)
    assert (sliding.qk_head_dim, sliding.head_dim) == (16, 8)
    assert model.support(0)["self_attn.attention_sinks"] is None
    assert "only to its sliding-window layers" in model.support(1)["self_attn.attention_sinks"]
    with pytest.raises(attnlens.Unavailable, match="sliding-window layers"):
        with model.trace(PROMPT):
            model.layers[1].self_attn.attention_sinks.save()
    got = trace(model, lambda m: {"p": m.layers[1].self_attn.attention_probabilities})
    assert torch.allclose(got["p"].sum(-1), torch.ones(1, 4, len(PROMPT)), atol=1e-6)


def test_mimo_values_carry_the_attention_value_scale():
    model = tiny("mimo_v2_flash")
    scale = model.config.attention_value_scale
    assert scale == 0.5
    got = trace(model, lambda m: {"x": m.layers[1].attention_norm_output, "v": m.layers[1].self_attn.attention_values})
    with torch.no_grad():
        projected = model.layers[1].self_attn._module.v_proj(got["x"]).view(1, len(PROMPT), 2, 8).transpose(1, 2)
    assert torch.allclose(got["v"], projected * scale, atol=1e-6)
    assert "attention_value_scale=0.5" in model.support(1).notes["self_attn.attention_values"]
