"""Zamba (attnlens/families/zamba.py): what the shared identities cannot see."""

from conftest import tiny
from identities import shared


def test_zamba_shares_one_weight_set():
    model = tiny("zamba")
    assert shared(model, 2).self_attn.q_proj.weight is shared(model, 3).self_attn.q_proj.weight
    assert "tied across the hybrid layers [2, 3]" in model.support(2).notes["self_attn.attention_output"]
