"""A request's KV cache as values on vLLM's paged cache, against the eager engine's transformers cache on the same
weights: reading it, overwriting a key, removing a position, and the refusals, with the same words on both engines.

Tolerance: float32 on both engines, 1e-4 relative (the suite's `close`): the paged cache holds the tensors the kernel
received, so the cached rows equal eager's keys to rounding, and the edited steps' logits equal eager's edited ones."""

import pytest
import torch
from conftest import pair
from test_equal_to_eager import close

import attnlens

LAYER = 1
POSITION = 3  # a prompt position every step has cached


@pytest.fixture(scope="module", params=["llama", "gemma2", "llama4_text"])
def engines(request, tmp_path_factory):
    """Llama (grouped heads), Gemma 2 (layer 0 slides over a 4-key window, layer 1 attends to all) and Llama 4 (vLLM
    caches its keys with each head's channels permuted: served and written in transformers' order)."""
    return pair(request.param, tmp_path_factory)


def same(a, b):
    """Equal shapes, and values within the suite's tolerance (an empty cache: nothing to compare)."""
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return torch.equal(a, b)
    return a.shape == b.shape and (a.numel() == 0 or close(a, b))


def generate(model, prompt, body, steps=3):
    """`body(step, attn, saved)` at each of `steps` greedy steps; returns what it saved and each step's last logits."""
    attn = model.layers[LAYER].self_attn
    with torch.no_grad(), model.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0) as tracer:
        saved = dict().save()
        logits = list().save()
        for step in tracer.iter[:steps]:
            body(step, attn, saved)
            logits.append(model.logits[:, -1].clone())
    return saved, logits


def read_cache(step, attn, saved):
    saved[step] = (
        attn.attention_cache_keys.clone(),
        attn.attention_cache_values.clone(),
        attn.attention_cache_visible.clone(),
        attn.attention_keys.clone(),
        attn.attention_values.clone(),
    )


def overwrite_key(step, attn, saved):
    if step == 1:
        keys = attn.attention_cache_keys
        keys[:, :, POSITION] = keys[:, :, POSITION] * -2.0
        attn.attention_cache_keys = keys
        saved["keys"] = attn.attention_keys.clone()


def remove_position(step, attn, saved):
    if step == 1:
        visible = attn.attention_cache_visible
        visible[:, POSITION] = False
        attn.attention_cache_visible = visible
    saved[step] = (
        attn.attention_cache_visible.clone(),
        attn.attention_queries.clone(),
        attn.attention_keys.clone(),
        attn.attention_values.clone(),
        attn.attention_head_outputs.clone(),
    )


def test_the_cache_read_at_a_step_is_the_keys_the_earlier_steps_wrote(engines):
    vllm, _ = generate(engines.vllm, engines.prompt, read_cache)
    eager, _ = generate(engines.eager, engines.prompt, read_cache)
    for step in range(3):
        for got, want in zip(vllm[step], eager[step]):
            assert same(got, want), step
    for step in (1, 2):  # the cache at step t is the keys and values attention saw at step t-1 (rotated keys)
        cached_keys, cached_values, visible, _, _ = vllm[step]
        keys, values = vllm[step - 1][3], vllm[step - 1][4]
        assert bool(visible.all()) and torch.equal(cached_keys, keys) and torch.equal(cached_values, values)


def test_the_sliding_layer_holds_only_its_window(tmp_path_factory):
    gemma = pair("gemma2", tmp_path_factory)
    got = {}
    for name, model in (("vllm", gemma.vllm), ("eager", gemma.eager)):
        attn = model.layers[0].self_attn
        with torch.no_grad(), model.generate(gemma.prompt, max_new_tokens=2, do_sample=False) as tracer:
            saved = list().save()
            for _ in tracer.iter[:2]:
                saved.append((attn.attention_cache_keys.clone(), attn.attention_cache_visible.clone()))
        got[name] = saved
    keys, visible = got["vllm"][1]
    seen = keys.shape[2]
    assert visible[0].tolist() == [False] * (seen - 3) + [True] * 3  # a 4-key window: 3 cached keys and the new one
    assert bool((keys[:, :, : seen - 3] == 0).all())
    for (k, v), (ek, ev) in zip(got["vllm"], got["eager"]):
        assert same(k, ek) and same(v, ev)


def test_an_overwritten_key_moves_later_steps_as_on_eager(engines):
    _, clean_logits = generate(engines.vllm, engines.prompt, lambda *_: None)
    vllm, vllm_logits = generate(engines.vllm, engines.prompt, overwrite_key)
    eager, eager_logits = generate(engines.eager, engines.prompt, overwrite_key)
    assert close(vllm_logits[0], clean_logits[0])  # the edit is at step 1
    assert not close(vllm_logits[1], clean_logits[1])
    for got, want in zip(vllm_logits, eager_logits):
        assert close(got, want)
    assert close(vllm["keys"], eager["keys"])  # the step attends to the edited key, at its position


def test_a_removed_position_is_masked_in_later_steps_as_by_hand(engines):
    vllm, vllm_logits = generate(engines.vllm, engines.prompt, remove_position)
    eager, eager_logits = generate(engines.eager, engines.prompt, remove_position)
    for got, want in zip(vllm_logits, eager_logits):
        assert close(got, want)
    for step in (1, 2):
        assert all(same(got, want) for got, want in zip(vllm[step], eager[step]))
    family, config = engines.vllm.family, engines.vllm.text_config
    heads = engines.vllm.layers[LAYER].self_attn
    for step in (1, 2):  # the removal holds at the step that wrote it and after
        visible, queries, keys, values, outputs = vllm[step]
        assert not bool(visible[0, POSITION]) and bool(visible[0, POSITION + 1 :].all())
        geometry = attnlens.HeadGeometry(
            heads.num_heads, heads.num_kv_heads, heads.head_dim, heads.qk_head_dim, heads.scale
        )
        scores = family.score_function("vllm").scores(geometry, config, queries, keys, LAYER)
        scores[..., POSITION] = torch.finfo(scores.dtype).min  # the key masked by hand
        pattern = family.score_function("vllm").softmax(scores)[0]
        by_hand = pattern @ values.repeat_interleave(heads.num_heads // heads.num_kv_heads, 1)
        assert close(outputs, by_hand.transpose(1, 2)), step


def refusal(model, prompt, body, layer=LAYER):
    attn = model.layers[layer].self_attn
    with pytest.raises((attnlens.EditError, attnlens.Unavailable)) as raised:
        with torch.no_grad(), model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
            for step in tracer.iter[:2]:
                if step == 1:
                    body(attn)
    return type(raised.value), str(raised.value).split("\n")[0]


def restore(attn):
    visible = attn.attention_cache_visible
    visible[:, 0] = False
    attn.attention_cache_visible = visible
    attn.attention_cache_visible = torch.ones_like(visible)


def too_long(attn):
    keys = attn.attention_cache_keys
    attn.attention_cache_keys = torch.cat([keys, keys[:, :, :1]], dim=2)  # a position past the request's


@pytest.mark.parametrize("body", [restore, too_long])
def test_bad_edits_are_refused_in_the_same_words_on_both_engines(llama, body):
    assert refusal(llama.vllm, llama.prompt, body) == refusal(llama.eager, llama.prompt, body)
