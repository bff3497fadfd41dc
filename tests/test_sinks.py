"""Attention sinks (GPT-OSS, DeepSeek-V4, MiMo-V2-Flash): the sink's share of the softmax, read between the scores and
the pattern.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import trace

import attnlens


@pytest.mark.parametrize(("case", "layer"), [("gpt_oss", 0), ("gpt_oss", 1), ("mimo_v2_flash", 0), ("deepseek_v4", 0)])
def test_sink_share_is_the_softmax_mass_of_the_sink_logit(case, layer):
    model = tiny(case)
    attn = model.layers[layer].self_attn
    got = trace(
        model,
        lambda m: {
            "s": m.layers[layer].self_attn.attention_scores,
            "sinks": m.layers[layer].self_attn.attention_sinks,
            "p": m.layers[layer].self_attn.attention_probabilities,
        },
    )
    logits = attn._module.sinks.detach().reshape(1, -1, 1, 1).expand(*got["s"].shape[:3], 1)
    by_hand = torch.cat([got["s"], logits], dim=-1).softmax(-1)
    assert torch.allclose(got["sinks"], by_hand[..., -1], atol=1e-6)
    assert torch.allclose(got["p"], by_hand[..., :-1], atol=1e-6)
    assert (got["sinks"] > 0).all() and got["sinks"].max() > 0.1  # the sink takes a real share


@pytest.mark.parametrize("case", ["gpt_oss", "deepseek_v4"])
def test_sinks_are_read_between_scores_and_pattern_and_are_read_only(case):
    model = tiny(case)
    order = model.order(0)
    assert (
        order["self_attn.attention_scores"]
        < order["self_attn.attention_sinks"]
        < order["self_attn.attention_probabilities"]
    )
    with pytest.raises(attnlens.OrderError, match="attention_sinks"):
        with model.trace(PROMPT):
            model.layers[0].self_attn.attention_probabilities.save()
            model.layers[0].self_attn.attention_sinks.save()
    with pytest.raises(attnlens.EditError, match="read-only"):
        with model.trace(PROMPT):
            model.layers[0].self_attn.attention_sinks = torch.zeros(1, 4, len(PROMPT))
    assert "read-only" in model.support(0).notes["self_attn.attention_sinks"]
