"""DeepseekV2 (attnlens/families/deepseek_v2.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import trace


def test_latent_attention_under_sdpa_serves_everything_but_the_pattern():
    eager, sdpa = tiny("deepseek_v2"), tiny("deepseek_v2", attn_implementation="sdpa")
    assert "attn_implementation='eager'" in sdpa.support(1)["self_attn.attention_probabilities"]
    names = ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs", "attention_premix")
    got = [trace(m, lambda m: {n: getattr(m.layers[1].self_attn, n) for n in names}) for m in (eager, sdpa)]
    for name in names:
        assert torch.allclose(got[0][name], got[1][name], atol=1e-5), name
