"""Olmo2 (attnlens/families/olmo2.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, heads, rope, saved_for

import attnlens


def test_olmo2_order_and_missing_norms():
    model = tiny("olmo2")
    assert model.order(1) == {
        "layer_input": 0,
        "self_attn.attention_cache_keys": 1,  # the cache as the attention enters
        "self_attn.attention_cache_values": 1,
        "self_attn.attention_cache_visible": 1,
        "self_attn.attention_queries": 2,
        "self_attn.attention_keys": 2,
        "self_attn.attention_key_positions": 2,
        "self_attn.attention_values": 2,
        "self_attn.attention_scores": 3,
        "self_attn.attention_probabilities": 4,
        "self_attn.attention_head_outputs": 5,
        "self_attn.attention_premix": 6,
        "self_attn.attention_output": 7,
        "layer_mid": 8,
        "mlp_input": 8,
        "mlp.mlp_activation": 9,
        "mlp.mlp_neurons": 10,
        "mlp.mlp_output": 11,
        "layer_output": 12,
    }
    report = model.support(1)
    assert report["attention_norm_output"].startswith("no norm in front of attention")
    assert report["mlp_norm_output"].startswith("no norm in front of the MLP")
    with pytest.raises(attnlens.Unavailable, match="no norm in front of the MLP"):
        with model.trace(PROMPT):
            model.layers[1].mlp_norm_output.save()
    with pytest.raises(attnlens.OrderError):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].mlp.mlp_output.save()
            model.layers[1].layer_mid.save()


def test_olmo2_layer_mid_is_the_mlp_input_after_the_post_norm():
    model = tiny("olmo2")
    saved = saved_for("olmo2")
    block = model.layers[1]._module
    mid = saved[(1, "layer_mid")]
    assert torch.equal(mid, saved[(1, "mlp_input")])
    with torch.no_grad():
        assert close(saved[(1, "layer_input")] + block.post_attention_layernorm(saved[(1, "attention_output")]), mid)
        assert not close(saved[(1, "layer_input")] + saved[(1, "attention_output")], mid)


def test_olmo2_qk_norm_spans_all_heads():
    model = tiny("olmo2")
    saved = saved_for("olmo2")
    module = model.layers[1].self_attn._module
    d = module.head_dim
    x = saved[(1, "layer_input")]  # attention reads the residual stream itself
    with torch.no_grad():
        q, k = rope(model, 1, heads(module.q_norm(module.q_proj(x)), d), heads(module.k_norm(module.k_proj(x)), d))
        raw = heads(module.q_proj(x), d)  # a per-head RMSNorm, for contrast
        per_head = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + module.q_norm.variance_epsilon)
        per_head = per_head * module.q_norm.weight.view(-1, d)[None, :, None]
        per_head, _ = rope(model, 1, per_head, k)
    assert close(q, saved[(1, "attention_queries")]) and close(k, saved[(1, "attention_keys")])
    assert not close(per_head, saved[(1, "attention_queries")])
