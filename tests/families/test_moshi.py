"""Moshi (attnlens/families/moshi.py): what the shared identities cannot see."""

from conftest import PROMPT, tiny
from identities import saved_for


def test_moshi_prefill_is_full_causal_beyond_its_configured_window():
    model, saved = tiny("moshi"), saved_for("moshi")
    assert model.config.sliding_window == 4 < len(PROMPT)
    assert (saved[(0, "attention_probabilities")][0, :, -1] > 0).all()  # the last query sees all 18 keys
    assert "ignores config.sliding_window (4)" in model.support(0).notes["self_attn.attention_probabilities"]
