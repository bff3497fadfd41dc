"""Under generate each forward call has its own values: decode steps have one query row and the whole cache."""

import torch
from conftest import PROMPT, tiny


def test_each_decode_step_sees_the_whole_cache(family):
    model = tiny(family)
    layer = 2
    attn = model.layers[layer].self_attn
    n = len(model.tokenizer(PROMPT).input_ids)
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0) as tracer:
        steps = list().save()
        for _ in tracer.iter[:3]:
            steps.append(
                (
                    attn.attention_queries,
                    attn.attention_keys,
                    attn.attention_values,
                    attn.attention_scores,
                    attn.attention_probabilities,
                    attn.attention_head_outputs,
                )
            )
    assert len(steps) == 3
    groups = attn.num_heads // attn.num_kv_heads
    # transformers keeps only the window in a sliding layer's cache, so its decode steps see the window's keys
    window = model.family.score_function().sliding_window(model.config, layer)
    for step, (q, k, v, scores, probs, heads) in enumerate(steps):
        rows = n if step == 0 else 1
        keys = n if step == 0 else n + step if window is None else min(n + step, window)
        assert q.shape[2] == rows and k.shape[2] == keys and probs.shape[2:] == (rows, keys)
        assert torch.allclose(
            model.family.score_function().scores(attn.heads, model.config, q, k, layer), scores, atol=1e-5
        )
        mixed = (probs @ v.repeat_interleave(groups, dim=1)).transpose(1, 2)
        assert torch.allclose(mixed, heads, atol=1e-5)
    # the decode step's keys extend the prefill's (or its window's tail): the cache is what the step attends over
    cached = steps[1][1][:, :, :-1]
    assert torch.allclose(cached, steps[0][1][:, :, n - cached.shape[2] :], atol=1e-6)


def test_an_edit_on_one_step_changes_only_later_tokens():
    model = tiny("llama")
    attn = model.layers[1].self_attn
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        with model.generate(PROMPT, **kwargs) as tracer:
            clean = tracer.result.save()
        with model.generate(PROMPT, **kwargs) as tracer:
            for _ in tracer.iter[2:3]:
                attn.attention_output = attn.attention_output * 0 + 5.0
            edited = tracer.result.save()
    n = len(model.tokenizer(PROMPT).input_ids)
    assert torch.equal(clean[:, : n + 2], edited[:, : n + 2])
    assert not torch.equal(clean[:, n + 2 :], edited[:, n + 2 :])
