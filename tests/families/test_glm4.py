"""Glm4 (attnlens/families/glm4.py): what the shared identities cannot see."""

import sys

import torch
from conftest import tiny
from identities import close, saved_for


def rope(model, layer, q, k):
    """The family's own rotary embedding (transformers' function and cos/sin), applied to [b, h, s, d] q and k."""
    module = model.layers[layer].self_attn._module
    positions = torch.arange(q.shape[2])[None]
    cos, sin = model._module.model.rotary_emb(q, positions)
    return sys.modules[type(module).__module__].apply_rotary_pos_emb(q, k, cos, sin)


def heads(x, head_dim):
    """[b, s, n * d] -> [b, n, s, d]."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def test_glm4_partial_rotary_leaves_the_tail_unrotated():
    model = tiny("glm4")
    saved = saved_for("glm4")
    module = model.layers[1].self_attn._module
    d = module.head_dim
    x = saved[(1, "attention_norm_output")]
    with torch.no_grad():
        raw_q, raw_k = heads(module.q_proj(x), d), heads(module.k_proj(x), d)
    q = saved[(1, "attention_queries")]
    rotary = int(d * model.config.rope_parameters["partial_rotary_factor"])
    assert 0 < rotary < d
    assert torch.equal(q[..., rotary:], raw_q[..., rotary:])
    assert not close(q[..., :rotary], raw_q[..., :rotary])
    assert close(rope(model, 1, raw_q, raw_k)[0], q)


def test_glm4_fused_mlp_activation_and_neurons():
    model = tiny("glm4")
    saved = saved_for("glm4")
    mlp = model.layers[1]._module.mlp
    with torch.no_grad():
        gate, up = mlp.gate_up_proj(saved[(1, "mlp_input")]).chunk(2, dim=-1)
        assert close(mlp.activation_fn(gate), saved[(1, "mlp_activation")])
    assert close(up * saved[(1, "mlp_activation")], saved[(1, "mlp_neurons")])
