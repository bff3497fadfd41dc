"""Doge (attnlens/families/doge.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, needs
from identities import N, perturbed, trace

import attnlens
from attnlens import heads
from attnlens.checks import failures, read_everything
from attnlens.models import char_tokenizer, tiny_model


def test_doge_dynamic_mask_from_the_values():
    needs("doge")
    model = perturbed("doge", {"A", "input_residual", "post_attention_residual"})
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    attn = model.layers[1].self_attn
    q, k, v, s = (
        saved[(1, name)] for name in ("attention_queries", "attention_keys", "attention_values", "attention_scores")
    )
    dynamic = attn.heads.dynamic_mask(v)
    assert dynamic.shape == (1, 2, N) and dynamic.std() > 1e-3  # it varies with the key
    plain = model.family.score_function().scores(attn.heads, model.config, q, k, 1, values=torch.zeros_like(v))
    assert not torch.allclose(plain, s, atol=1e-3)  # the values matter
    with pytest.raises(ValueError, match="needs the layer's values"):
        model.family.score_function().scores(attn.heads, model.config, q, k, 1)
    assert "values" in heads.why_not(model, 1)
    assert "dynamic mask" in model.support(1).notes["self_attn.attention_scores"]


def test_doge_keep_window_masks_the_smallest_dynamic_mask():
    needs("doge")
    model = perturbed("doge", {"A"}, keep_window_size=5)
    got = trace(
        model,
        lambda m: {
            name: getattr(m.layers[0].self_attn, name)
            for name in (
                "attention_queries",
                "attention_keys",
                "attention_values",
                "attention_scores",
                "attention_probabilities",
            )
        },
    )
    probs = got["attention_probabilities"][0]
    assert ((probs > 0).sum(-1) <= 5).all() and ((probs > 0).sum(-1)[:, -1] == 5).all()
    rebuilt = model.family.score_function().scores(
        model.layers[0].self_attn.heads,
        model.config,
        got["attention_queries"],
        got["attention_keys"],
        0,
        values=got["attention_values"],
    )
    assert torch.equal(rebuilt == torch.finfo(rebuilt.dtype).min, got["attention_scores"] == rebuilt.min())
    assert torch.allclose(rebuilt, got["attention_scores"], atol=1e-5)


def test_doge_sdpa_is_not_rebuilt_and_cdmoe_layers():
    needs("doge")
    sdpa = attnlens.StandardizedTransformer(
        tiny_model("doge", attn_implementation="sdpa"), tokenizer=char_tokenizer(), rebuild_patterns=True
    )
    assert "depend on the values" in sdpa.support(0)["self_attn.attention_probabilities"]
    moe = attnlens.models.tiny("doge", is_moe=True, num_experts=16, num_experts_per_tok=4)
    saved = read_everything(moe, PROMPT)
    assert [failures(moe, saved, i) for i in range(3)] == [[], [], []]
    assert "CDMoE" in moe.support(0)["mlp.mlp_neurons"] and "view(2" in moe.support(0).notes["mlp.mlp_output"]
