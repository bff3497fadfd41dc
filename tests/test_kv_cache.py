"""A request's KV cache as values on the transformers engine (`attnlens/locations/cache.py`): the cache read at a step
is what the earlier steps' attention received; an overwritten key moves the next step exactly as transformers run by
hand on the edited cache; a removed position equals masking that key by hand; and the refusals name what was wrong.
The same checks against vLLM's paged cache are tests_vllm/test_kv_cache.py. Float32: the identities are exact or to
1e-5 (a softmax recomputed by hand)."""

import pytest
import torch

import attnlens
from attnlens.access import Access

PROMPT = "Hello world"  # 11 tokens
LAYER = 1
POSITION = 3


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma2", "bert"])
def model(request):
    """Llama, Qwen3 (grouped heads, QK-norm), Gemma 2 (layer 0 slides over 4 keys; soft-capped scores) and BERT's
    causal LM (its block passes the attention mask to the attention by position)."""
    return attnlens.models.tiny(request.param)


def generate(model, body, steps=3, prompt=PROMPT):
    attn = model.layers[LAYER].self_attn
    with torch.no_grad(), model.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0) as tracer:
        saved = dict().save()
        logits = list().save()
        for step in tracer.iter[:steps]:
            body(step, attn, saved)
            logits.append(model.logits[:, -1].clone())
    return saved, logits


def by_hand(model, prompt=PROMPT, edit=None, mask=None):
    """transformers run by hand: the prompt, `edit(cache)`, then the greedy next token (with a 2-D `mask` over the
    cache and the token); the second step's last logits."""
    hf = model._module
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        first = hf(ids, use_cache=True)
        cache = first.past_key_values
        if edit is not None:
            edit(cache)
        token = first.logits[:, -1].argmax(-1, keepdim=True)
        position = torch.tensor([[ids.shape[1]]])
        return hf(token, past_key_values=cache, attention_mask=mask, position_ids=position).logits[:, -1]


def test_the_cache_at_a_step_is_what_the_earlier_steps_attention_received(model):
    def body(step, attn, saved):
        saved[step] = (
            attn.attention_cache_keys.clone(),
            attn.attention_cache_values.clone(),
            attn.attention_cache_visible.clone(),
            attn.attention_keys.clone(),
            attn.attention_values.clone(),
        )

    saved, _ = generate(model, body)
    assert saved[0][0].shape[2] == 0 and saved[0][2].shape == (1, 0)  # nothing cached before the prompt
    for step in (1, 2):
        keys, values, visible, _, _ = saved[step]
        assert keys.shape[2] == values.shape[2] == visible.shape[1] == 10 + step
        assert bool(visible.all())
        # the keys attention received at the step before (rotated, QK-normed): the cache stores them as they are
        assert torch.equal(keys, saved[step - 1][3]) and torch.equal(values, saved[step - 1][4])


def test_a_cache_of_repeated_heads_is_served_per_key_value_head():
    """Falcon's new decoder architecture caches each key/value head repeated for every query head of its group: the
    cache is served as [batch, num_kv_heads, ...] (what its attention received), and a write lands in every copy."""
    falcon = attnlens.models.tiny("falcon:new_architecture")
    kv_heads = falcon.layers[LAYER].self_attn.num_kv_heads
    new_key = torch.randn(1, kv_heads, falcon.layers[LAYER].self_attn.qk_head_dim)

    def body(step, attn, saved):
        cached = attn.attention_cache_keys.clone()
        if step == 1:
            edited = cached.clone()
            edited[:, :, POSITION] = new_key
            attn.attention_cache_keys = edited
        saved[step] = (cached, attn.attention_keys.clone())

    def edit(cache):
        repeats = cache.layers[LAYER].keys.shape[1] // kv_heads
        cache.layers[LAYER].keys[:, :, POSITION] = new_key.repeat_interleave(repeats, dim=1)

    saved, logits = generate(falcon, body, steps=2)
    assert falcon._module.config.num_attention_heads > kv_heads
    assert saved[1][0].shape[1] == kv_heads and torch.equal(saved[1][0], saved[0][1])
    assert torch.allclose(logits[1], by_hand(falcon, edit=edit), atol=1e-5)


def test_an_overwritten_key_moves_the_next_step_as_transformers_run_on_the_edited_cache(model):
    new_key = torch.randn(1, model.layers[LAYER].self_attn.num_kv_heads, model.layers[LAYER].self_attn.qk_head_dim)

    def body(step, attn, saved):
        if step == 1:
            keys = attn.attention_cache_keys
            keys[:, :, POSITION] = new_key
            attn.attention_cache_keys = keys
            saved["keys"] = attn.attention_keys.clone()

    def edit(cache):
        cache.layers[LAYER].keys[:, :, POSITION] = new_key

    saved, logits = generate(model, body, steps=2)
    clean = by_hand(model)
    assert torch.equal(saved["keys"][:, :, POSITION], new_key)
    assert torch.allclose(logits[1], by_hand(model, edit=edit), atol=1e-5)
    assert not torch.allclose(logits[1], clean, atol=1e-3)


def test_an_overwritten_value_lands_too(model):
    def body(step, attn, saved):
        if step == 1:
            attn.attention_cache_values = attn.attention_cache_values * 0
            saved["values"] = attn.attention_values.clone()

    saved, _ = generate(model, body, steps=2)
    assert bool((saved["values"][:, :, :-1] == 0).all()) and bool(saved["values"][:, :, -1].abs().sum() > 0)


def remove(step, attn, saved):
    if step == 1:
        visible = attn.attention_cache_visible
        visible[:, POSITION] = False
        attn.attention_cache_visible = visible
    if step >= 1:
        saved[step] = (
            attn.attention_cache_visible.clone(),
            attn.attention_queries.clone(),
            attn.attention_keys.clone(),
            attn.attention_values.clone(),
            attn.attention_head_outputs.clone(),
        )


def test_a_removed_position_is_that_key_masked_by_hand_at_every_later_step(model):
    saved, _ = generate(model, remove)
    heads = model.layers[LAYER].self_attn
    geometry = attnlens.HeadGeometry(
        heads.num_heads, heads.num_kv_heads, heads.head_dim, heads.qk_head_dim, heads.scale
    )
    for step in (1, 2):
        visible, queries, keys, values, outputs = saved[step]
        assert visible[0].tolist() == [i != POSITION for i in range(visible.shape[1])]
        scores = model.family.score_function().scores(geometry, model.config, queries, keys, LAYER)
        scores[..., POSITION] = torch.finfo(scores.dtype).min
        pattern = model.family.score_function().softmax(scores)[0]
        mixed = pattern @ values.repeat_interleave(heads.num_heads // heads.num_kv_heads, 1)
        assert torch.allclose(outputs, mixed.transpose(1, 2), atol=1e-5), step


def test_removing_a_position_from_every_layer_equals_a_padding_mask_on_it():
    llama = attnlens.models.tiny("llama", attn_implementation="sdpa")  # sdpa: its mask-free causal path is built

    def body(step, attn, saved):
        if step == 1:
            for layer in llama.layers:
                visible = layer.self_attn.attention_cache_visible
                visible[:, POSITION] = False
                layer.self_attn.attention_cache_visible = visible

    _, logits = generate(llama, body, steps=2)
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, POSITION] = 0
    assert torch.allclose(logits[1], by_hand(llama, mask=mask), atol=1e-5)
    assert not torch.allclose(logits[1], by_hand(llama), atol=1e-3)


def test_a_sliding_layer_holds_its_window_and_refuses_an_edit_outside_it():
    gemma = attnlens.models.tiny("gemma2")  # layer 0 slides over 4 keys
    window = gemma.layers[0].self_attn
    with torch.no_grad(), gemma.generate(PROMPT, max_new_tokens=2, do_sample=False) as tracer:
        saved = list().save()
        for _ in tracer.iter[:2]:
            saved.append((window.attention_cache_keys.clone(), window.attention_cache_visible.clone()))
    keys, visible = saved[1]
    assert visible[0].tolist() == [False] * 8 + [True] * 3  # 3 cached keys and the new one make the window
    assert bool((keys[:, :, :8] == 0).all()) and bool((keys[:, :, 8:] != 0).any())
    with pytest.raises(attnlens.EditError, match=r"position 0 has left layer 0's sliding window"):
        with torch.no_grad(), gemma.generate(PROMPT, max_new_tokens=2, do_sample=False) as tracer:
            for step in tracer.iter[:2]:
                if step == 1:
                    window.attention_cache_keys = window.attention_cache_keys + 1


def test_support_and_order_place_the_cache_at_the_attentions_input():
    llama = attnlens.models.tiny("llama")
    order = llama.order(1)
    names = ["attention_norm_output", "self_attn.attention_cache_keys", "self_attn.attention_queries"]
    assert order[names[0]] < order[names[1]] < order[names[2]]
    assert order["self_attn.attention_cache_values"] == order["self_attn.attention_cache_visible"] == order[names[1]]
    assert "a copy" in llama.support(1).notes["self_attn.attention_cache_keys"]
    with pytest.raises(attnlens.OrderError):
        with torch.no_grad(), llama.trace(PROMPT):
            llama.layers[1].self_attn.attention_queries.save()
            llama.layers[1].self_attn.attention_cache_keys.save()


def test_bad_writes_are_refused_naming_what_was_wrong():
    llama = attnlens.models.tiny("llama")
    attn = llama.layers[LAYER].self_attn

    def at_step_one(edit):
        with torch.no_grad(), llama.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
            for step in tracer.iter[:2]:
                if step == 1:
                    edit()

    def too_long():  # a position past the request's
        keys = attn.attention_cache_keys
        attn.attention_cache_keys = torch.cat([keys, keys[:, :, :1]], dim=2)

    def restore():
        visible = attn.attention_cache_visible
        visible[:, 0] = False
        attn.attention_cache_visible = visible
        attn.attention_cache_visible = torch.ones_like(visible)

    def in_place():
        attn.attention_cache_keys[:, :, 0] = 0
        attn.attention_queries.save()

    with pytest.raises(attnlens.EditError, match=r"position=11, qk_head_dim=16\]; got shape \[1, 2, 12, 16\]"):
        at_step_one(too_long)
    with pytest.raises(attnlens.EditError, match="position 0 is not attended to"):
        at_step_one(restore)
    with pytest.raises(attnlens.EditError, match="copy of the request's KV cache"):
        at_step_one(in_place)


def test_a_static_cache_is_refused_by_its_class():
    llama = attnlens.models.tiny("llama")
    with pytest.raises(attnlens.Unavailable, match="transformers' StaticLayer; attnlens reads and edits DynamicLayer"):
        with torch.no_grad(), llama.generate(PROMPT, max_new_tokens=2, cache_implementation="static") as tracer:
            for step in tracer.iter[:2]:
                if step == 1:
                    llama.layers[1].self_attn.attention_cache_keys.save()


@pytest.mark.parametrize(
    ("case", "layer", "words"),
    [
        ("deepseek_v3", 1, "latent attention (MLA) caches one compressed latent"),
        ("gemma4_unified_text:kv_shared", 3, "layer 3 attends with layer 1's cached keys and values (shared KV)"),
        ("qwen3_next", 0, "layer 0 keeps no key/value cache"),
    ],
)
def test_families_without_a_standard_cache_refuse_it_in_the_same_words_on_both_engines(case, layer, words):
    model = attnlens.models.tiny(case)
    on_vllm = Access(model.family, model.config, model.num_layers, "vllm", model.access.geometry)
    for name in ("attention_cache_keys", "attention_cache_values", "attention_cache_visible"):
        reason = model.support(layer)[f"self_attn.{name}"]
        assert reason is not None and words in reason
        assert on_vllm.support(layer).reasons[f"self_attn.{name}"] == reason
    with pytest.raises(attnlens.Unavailable, match=words.replace("(", r"\(").replace(")", r"\)")):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[layer].self_attn.attention_cache_keys.save()
