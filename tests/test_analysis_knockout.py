"""Edge knockouts move the logits exactly as a hand recomputation predicts: the layer's head outputs rebuilt from its
queries, keys and values with the knocked-out keys masked before the softmax, assigned in a plain run."""

import pytest
import torch
from conftest import PROMPT, tiny

import attnlens
from attnlens.analysis import knock_out, knocked

LAYER, HEADS, QUERIES, KEYS = 1, [0, 2], list(range(8, 18)), [0, 1, 2, 5]


def by_hand(model, prompt, layer, heads, queries, keys):
    """The head outputs of `layer` with the edges removed, from its queries, keys and values (masked scores)."""
    attn = model.layers[layer].self_attn
    with torch.no_grad(), model.trace(prompt):
        q, k, v = (getattr(attn, name).save() for name in ("attention_queries", "attention_keys", "attention_values"))
    family = model.family
    scores = family.score_function().scores(attn.heads, model.config, q, k, layer)
    length = q.shape[2]
    edges = torch.zeros(attn.num_heads, length, length, dtype=torch.bool)
    for head in heads:
        for query in queries:
            edges[head, query, keys] = True
    scores = scores.masked_fill(edges[None], torch.finfo(scores.dtype).min)
    pattern = scores.softmax(-1)
    return (pattern @ family.score_function().repeat_kv(v, attn.num_heads // attn.num_kv_heads)).transpose(1, 2)


@pytest.mark.parametrize("case", ["llama", "gpt2", "qwen3"])
def test_knockout_equals_the_hand_recomputation(case):
    model = tiny(case)
    with torch.no_grad(), model.trace(PROMPT):
        knock_out(model, LAYER, QUERIES, KEYS, heads=HEADS)
        pattern = model.layers[LAYER].self_attn.attention_probabilities.save()
        knocked_logits = model.logits.save()
    assert bool((pattern[0][HEADS][:, QUERIES][..., KEYS] == 0).all())
    assert torch.allclose(pattern.sum(-1), torch.ones_like(pattern.sum(-1)), atol=1e-5)
    heads = by_hand(model, PROMPT, LAYER, HEADS, QUERIES, KEYS)
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[LAYER].self_attn.attention_head_outputs = heads
        expected = model.logits.save()
    with torch.no_grad(), model.trace(PROMPT):
        plain = model.logits.save()
    assert torch.allclose(knocked_logits, expected, atol=1e-5)
    assert not torch.allclose(knocked_logits, plain, atol=1e-3)  # the knockout moved them


def test_every_decode_step():
    model = tiny("llama")
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
        steps = list().save()
        attn = model.layers[LAYER].self_attn
        for _ in tracer.iter[:3]:
            values = attn.attention_values
            knock_out(model, LAYER, None, [0, 1], heads=None)  # no query reads the first two tokens
            steps.append((attn.attention_probabilities.clone(), values, attn.attention_head_outputs))
    assert len(steps) == 3
    for pattern, values, heads in steps:
        assert bool((pattern[..., [0, 1]] == 0).all())
        mixed = (pattern @ values.repeat_interleave(2, dim=1)).transpose(1, 2)
        assert torch.allclose(mixed, heads, atol=1e-5)


def test_knocked_keeps_a_row_total():
    pattern = torch.tensor([[[[0.5, 0.3, 0.2]]]])
    assert torch.allclose(knocked(pattern, None, [0]), torch.tensor([[[[0.0, 0.6, 0.4]]]]))
    assert torch.allclose(knocked(pattern * 0.5, None, [0]), torch.tensor([[[[0.0, 0.3, 0.2]]]]))  # a sink's share
    with pytest.raises(ValueError, match="out of range"):
        knocked(pattern, None, [0], heads=[3])
    sdpa = tiny("llama", attn_implementation="sdpa")
    with pytest.raises(attnlens.Unavailable, match="knock_out"), torch.no_grad(), sdpa.trace(PROMPT):
        knock_out(sdpa, 0, None, [0])
