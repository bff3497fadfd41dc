"""Olmo (attnlens/families/olmo.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, heads, rope, saved_for


@pytest.mark.parametrize("case", ["olmo", "olmo:noclip"])
def test_olmo_reads_queries_keys_values_after_the_clamp(case):
    model = tiny(case)
    clip = model.config.clip_qkv
    saved = saved_for(case)
    module = model.layers[1].self_attn._module
    d = module.head_dim
    x = saved[(1, "attention_norm_output")]
    with torch.no_grad():
        raw = [heads(proj(x), d) for proj in (module.q_proj, module.k_proj, module.v_proj)]
    clipped = [t.clamp(-clip, clip) for t in raw] if clip is not None else raw
    q, k = rope(model, 1, clipped[0], clipped[1])
    assert close(q, saved[(1, "attention_queries")]) and close(k, saved[(1, "attention_keys")])
    assert torch.equal(clipped[2], saved[(1, "attention_values")])
    unclipped = max(t.abs().max() for t in raw)
    assert unclipped > 1.5  # the projections reach past the tiny clip of 1, so the clip binds when set
    if clip is not None:
        values = saved[(1, "attention_values")]
        assert values.abs().max() == clip and (values.abs() == clip).float().mean() > 0.1
        assert not close(rope(model, 1, raw[0], raw[1])[0], saved[(1, "attention_queries")])
        assert "clamped in place" in model.support(1).notes["self_attn.attention_values"]


def test_olmo_value_edits_land_after_the_clamp():
    model = tiny("olmo")
    attn = model.layers[1].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_values = attn.attention_values * 10
        values = attn.attention_values.save()
        probs = attn.attention_probabilities.save()
        out = attn.attention_head_outputs.save()
    assert values.abs().max() == 10 * model.config.clip_qkv  # not clamped again
    assert close((probs @ values.repeat_interleave(2, dim=1)).transpose(1, 2), out)
