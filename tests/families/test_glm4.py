"""Glm4 (attnlens/families/glm4.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, heads, rope, saved_for


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
