"""Phi3 (attnlens/families/phi3.py): what the shared identities cannot see."""

import sys

import torch
from conftest import tiny
from identities import close, saved_for

LAYER = 1


def at(case, name, layer=LAYER):
    return saved_for(case)[(layer, name)]


def heads(x, head_dim):
    """[b, s, n * d] -> [b, n, s, d]."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def attention_module(case, layer=LAYER):
    return tiny(case).layers[layer].self_attn._module


def test_phi3_fused_qkv_and_gate_up():
    model = tiny("phi3")
    module = attention_module("phi3")
    h, kv, d = model.config.num_attention_heads, model.config.num_key_value_heads, module.head_dim
    with torch.no_grad():
        fused = module.qkv_proj(at("phi3", "attention_norm_output"))
        q, k, v = (heads(part, d) for part in fused.split([h * d, kv * d, kv * d], dim=-1))
        cos, sin = model._module.model.rotary_emb(q, torch.arange(q.shape[2])[None])
        q, k = sys.modules[type(module).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(at("phi3", "attention_values"), v)
    assert close(at("phi3", "attention_queries"), q) and close(at("phi3", "attention_keys"), k)
    mlp = model.layers[LAYER].mlp._module
    with torch.no_grad():
        gate, up = mlp.gate_up_proj(at("phi3", "mlp_input")).chunk(2, dim=-1)
    activation = at("phi3", "mlp_activation")
    assert close(activation, mlp.activation_fn(gate))
    assert close(at("phi3", "mlp_neurons"), up * activation)
