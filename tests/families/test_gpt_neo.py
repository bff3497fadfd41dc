"""GPTNeo (attnlens/families/gpt_neo.py): what the shared identities cannot see."""

import math

import torch
from conftest import tiny
from identities import N, saved_for


def test_gpt_neo_scores_are_unscaled_and_future_keys_masked_twice():
    model = tiny("gpt_neo")
    saved = saved_for("gpt_neo")
    assert [model.family.score_function().sliding_window(model.config, i) for i in range(3)] == [None, 4, None]
    assert model.layers[0].self_attn.scale == 1.0
    back = torch.arange(N)[:, None] - torch.arange(N)[None, :]
    for layer in range(3):
        q, k, s = (saved[(layer, name)] for name in ("attention_queries", "attention_keys", "attention_scores"))
        seen = (back >= 0) & (back < (4 if layer == 1 else N))
        assert torch.equal(s[..., seen], (q @ k.transpose(-1, -2))[..., seen])  # no 1/sqrt(d)
        assert (s[..., back < 0] == -math.inf).all()  # the buffer's finfo.min plus the causal mask's
        assert (s[..., (back >= 0) & ~seen] == torch.finfo(torch.float32).min).all()
        assert ((back >= 0) & ~seen).any() == (layer == 1)
    assert "-inf" in model.support(1).notes["self_attn.attention_scores"]
