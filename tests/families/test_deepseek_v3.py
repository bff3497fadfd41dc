"""DeepseekV3 (attnlens/families/deepseek_v3.py): what the shared identities cannot see."""

import math

import pytest
import torch
from conftest import PROMPT, tiny
from identities import trace


def test_yarn_mscale_is_part_of_the_score_scale():
    plain, yarn = tiny("deepseek_v3"), tiny("deepseek_v3:yarn")
    qk = plain.config.qk_nope_head_dim + plain.config.qk_rope_head_dim
    assert plain.layers[0].self_attn.scale == pytest.approx(qk**-0.5)
    rope = yarn.config.rope_parameters
    mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
    attn = yarn.layers[0].self_attn
    assert attn.scale == pytest.approx(qk**-0.5 * mscale**2) and attn.scale > qk**-0.5 * 1.2
    got = trace(
        yarn,
        lambda m: {
            "q": m.layers[0].self_attn.attention_queries,
            "k": m.layers[0].self_attn.attention_keys,
            "s": m.layers[0].self_attn.attention_scores,
        },
    )
    causal = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril()
    by_hand = (got["q"] @ got["k"].transpose(2, 3) * qk**-0.5 * mscale**2)[..., causal]
    assert torch.allclose(got["s"][..., causal], by_hand, atol=1e-5)
