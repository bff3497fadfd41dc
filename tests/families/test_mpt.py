"""MPT (attnlens/families/mpt.py): what the shared identities cannot see."""

import pytest
from conftest import PROMPT
from identities import failures, read_everything

import attnlens


def test_mpt_clip_qkv_clamps_queries_keys_and_values():
    model = attnlens.models.tiny("mpt", attn_config={"clip_qkv": 0.3})
    saved = read_everything(model, PROMPT)
    for name in ("attention_queries", "attention_keys", "attention_values"):
        assert saved[(1, name)].abs().max() == pytest.approx(0.3)  # binds
    assert all(failures(model, saved, layer) == [] for layer in range(model.num_layers))
    assert "clip_qkv" in model.support(1).notes["self_attn.attention_keys"]
