"""GPTJ (attnlens/families/gptj.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, tiny
from identities import LAYER, at, visible

import attnlens
from attnlens.models import char_tokenizer, tiny_model


def test_gptj_scores_are_float32_in_a_bfloat16_model():
    model = attnlens.StandardizedTransformer(tiny_model("gptj").to(torch.bfloat16), tokenizer=char_tokenizer())
    attn = model.layers[LAYER].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        q, k = attn.attention_queries.save(), attn.attention_keys.save()
        scores, probs = attn.attention_scores.save(), attn.attention_probabilities.save()
    assert q.dtype == torch.bfloat16 and scores.dtype == torch.float32 and probs.dtype == torch.bfloat16
    assert torch.equal(model.family.score_function().scores(attn.heads, model.config, q, k, LAYER), scores)
    masked = ~visible(model.config, model.family, LAYER, q.shape[2])
    assert (scores[..., masked] < torch.finfo(torch.bfloat16).min / 2).all()
    assert "float32" in model.support(LAYER).notes["self_attn.attention_scores"]


def test_gptj_head_output_edits_land_in_place():
    """On transformers 5.19 the head outputs are a transposed view of `_attn`'s output; in-place edits still land."""
    model = tiny("gptj")
    attn = model.layers[LAYER].self_attn
    d = attn.head_dim
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_head_outputs[:, :, 0] = 0
        premix = attn.attention_premix.save()
    assert (premix[..., :d] == 0).all() and torch.equal(premix[..., d:], at("gptj", "attention_premix")[..., d:])
