"""DiffLlama (attnlens/families/diffllama.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, saved_for

import attnlens


def test_diffllama_heads_mix_doubled_values_then_combine_in_pairs():
    model, saved = tiny("diffllama"), saved_for("diffllama")
    attn = model.layers[1].self_attn
    module = attn._module
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qk_head_dim) == (4, 2, 32, 16)
    with torch.no_grad():
        x = saved[(1, "attention_norm_output")]
        v = module.v_proj(x).view(1, len(PROMPT), 2, 16).transpose(1, 2)
        values = saved[(1, "attention_values")]
        # kv head g carries [v_(g mod kv/2) | v_(g mod kv/2 + kv/2)]
        assert close(values[:, 0], torch.cat([v[:, 0], v[:, 1]], -1)) and close(values[:, 1], values[:, 0])
        heads = saved[(1, "attention_head_outputs")]
        lam = (
            torch.exp((module.lambda_q1 * module.lambda_k1).sum())
            - torch.exp((module.lambda_q2 * module.lambda_k2).sum())
            + module.lambda_init
        )
        pair = heads[:, :, 0] - lam * heads[:, :, 2]  # head 0 with head 0 + num_heads / 2
        premix = saved[(1, "attention_premix")].view(1, len(PROMPT), 2, 32)
        assert close((1 - module.lambda_init) * module.groupnorm(pair), premix[:, :, 0])
    assert "differential head j" in model.support(1).notes["self_attn.attention_probabilities"]


@pytest.mark.parametrize("value", ["attention_values", "attention_probabilities"])
def test_diffllama_refuses_edits_that_would_reach_one_call(value):
    model = tiny("diffllama")
    with pytest.raises(attnlens.EditError):
        with torch.no_grad(), model.trace(PROMPT):
            attn = model.layers[0].self_attn
            setattr(attn, value, getattr(attn, value) * 0)
