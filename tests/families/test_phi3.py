"""Phi3 (attnlens/families/phi3.py): what the shared identities cannot see."""

import sys

import torch
from conftest import tiny
from identities import LAYER, at, attention_module, close, heads


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
