"""Kolibri1_1 (attnlens/families/kolibri1_1.py): what the shared identities cannot see. The tiny recipe's indexer
budget covers every test prompt (the identities hold on the causal mask); here it binds: index_topk=2, one sink and
two local keys, so a query sees 5 of up to 18 keys."""

import pytest
import torch
from conftest import PROMPT, needs, tiny
from identities import N, heads, ids, rope, trace

import attnlens
from attnlens.models import char_tokenizer, tiny_model

BINDING = {"index_topk": 2, "index_num_local_tokens": 2, "index_num_sink_tokens": 1}
BUDGET = 5
CAUSAL = torch.ones(N, N, dtype=torch.bool).tril()
VALUES = ("attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_probabilities")


def modeling():
    from transformers.models.kolibri1_1 import modeling_kolibri1_1  # (transformers 5.25 on: tiny() skips before)

    return modeling_kolibri1_1


def indexer_outputs(model, layers=(1, 2)):
    """Each indexed layer's (chosen [query, key], pool [query, key]) on PROMPT: its own trace, the indexer is no
    standardized value."""
    found = {}
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            found[i] = model.layers[i].self_attn.indexer.output.save()
    return {i: (chosen[0, 0], pool[0]) for i, (chosen, pool) in found.items()}


def read(model, layers=(1, 2), names=VALUES):
    return trace(
        model,
        lambda m: {
            (i, name): getattr(m.layers[i], name)
            if name == "attention_norm_output"
            else getattr(m.layers[i].self_attn, name)
            for i in layers
            for name in names
        },
    )


def by_hand_choice(config, queries, routing_keys):
    """Kolibri 1.1's choice without a binding pool, written out: the first sink keys, the last local ones (the query
    included) and the index_topk others scoring highest (ReLU of query heads 0.. index_num_heads-1 against key head
    0, both NVFP4-rounded, averaged; ties to earlier keys). `routing_keys` [key, dim] unrounded."""
    nvfp4 = modeling().nvfp4_fake_quantize
    q = nvfp4(queries[0, : config.index_num_heads])
    k = nvfp4(routing_keys)
    score = (q @ k.T).relu().sum(0) * (config.head_dim**-0.5 / config.index_num_heads)
    sinks, local = config.index_num_sink_tokens, config.index_num_local_tokens
    chosen = torch.zeros(N, N, dtype=torch.bool)
    for row in range(N):
        if row + 1 <= BUDGET:
            chosen[row, : row + 1] = True
            continue
        chosen[row, :sinks] = True
        chosen[row, row + 1 - local : row + 1] = True
        candidates = torch.arange(sinks, row + 1 - local)
        order = torch.sort(-score[row, candidates], stable=True).indices  # stable: ties to the earlier key
        chosen[row, candidates[order[: config.index_topk]]] = True
    return chosen


def test_indexed_layers_attend_to_exactly_the_keys_the_indexer_chose():
    """Both indexed layers (1 chooses a pool, 2 rescores it with layer 1's keys and values): the pattern is exactly
    zero off the indexer's choice; the scores equal q.k * scale on the chosen keys and the dtype's minimum elsewhere;
    the choice is what the served queries and the keys (before their NVFP4 rounding) give by hand, so the queries are
    the indexer's own; the family's causal score function equals the scores on the chosen keys."""
    model = tiny("kolibri1_1", **BINDING)
    config = model.config
    chosen = indexer_outputs(model)
    got = read(model, names=("attention_norm_output", *VALUES))
    layer1 = model.layers[1].self_attn._module
    x = got[1, "attention_norm_output"]
    with torch.no_grad():
        raw_keys = layer1.k_norm(heads(layer1.k_proj(x), 16))  # layer 1's keys before rounding: layer 2's too
        raw_values = heads(layer1.v_proj(x), 16)
    minimum = torch.finfo(torch.float32).min
    for layer in (1, 2):
        sees = chosen[layer][0]
        assert not torch.equal(sees, CAUSAL) and not (sees & ~CAUSAL).any()  # the choice binds, and is causal
        assert torch.equal(sees.sum(-1), torch.arange(1, N + 1).clamp(max=BUDGET))
        assert torch.equal(sees, by_hand_choice(config, got[layer, "attention_queries"], raw_keys[0, 0]))
        q, k, scores, probs = (got[layer, name] for name in ("attention_queries", "attention_keys", *VALUES[3:]))
        assert torch.equal(probs[0] > 0, sees.expand(4, N, N))
        products = q @ k.repeat_interleave(2, 1).transpose(2, 3) * 16**-0.5
        assert torch.allclose(scores, products.masked_fill(~sees, minimum), atol=1e-5)
        rebuilt = model.family.score_function().scores(model.layers[layer].self_attn.heads, config, q, k, layer)
        assert torch.allclose(rebuilt[..., sees], scores[..., sees], atol=1e-5)
        # what the attention function receives: the keys and values rounded to NVFP4, layer 1's on both layers
        assert torch.equal(k, modeling().nvfp4_fake_quantize(raw_keys))
        assert torch.equal(got[layer, "attention_values"], modeling().nvfp4_fake_quantize(raw_values))
    assert not hasattr(model.layers[2].self_attn._module, "k_proj")
    assert torch.equal(chosen[1][1], CAUSAL)  # the pool (18 keys <= 128) is every key
    assert torch.equal(chosen[2][1], chosen[1][1])


def test_past_index_pool_size_the_choice_keeps_to_the_pool_of_layer_1s_indexer():
    """With index_pool_size=8 a query seeing more keys chooses among layer 1's blocks only, on layer 2 too (a
    reindexer: index_layers=[1]); the pattern stays exactly zero off the choice and the score function equal on it."""
    model = tiny("kolibri1_1", index_pool_size=8, index_compression=2, **BINDING)
    chosen = indexer_outputs(model)
    pool = chosen[1][1]
    assert torch.equal(chosen[2][1], pool)
    assert not torch.equal(pool, CAUSAL) and torch.equal(pool[:8], CAUSAL[:8])  # binds past 8 keys only
    got = read(model)
    positions = torch.arange(N)
    sinks = (positions < 1)[None].expand(N, N)
    local = (positions[None] > positions[:, None] - 2) & CAUSAL
    for layer in (1, 2):
        sees = chosen[layer][0]
        assert not (sees & ~(pool | sinks | local)).any()
        probs, scores = got[layer, "attention_probabilities"], got[layer, "attention_scores"]
        assert torch.equal(probs[0] > 0, sees.expand(4, N, N))
        rebuilt = model.family.score_function().scores(
            model.layers[layer].self_attn.heads,
            model.config,
            got[layer, "attention_queries"],
            got[layer, "attention_keys"],
            layer,
        )
        assert torch.allclose(rebuilt[..., sees], scores[..., sees], atol=1e-5)


def test_sliding_layers_rotate_and_indexed_layers_do_not():
    model = tiny("kolibri1_1")
    got = read(model, (0, 1), ("attention_norm_output", "attention_queries", "attention_keys"))
    for layer in (0, 1):
        module = model.layers[layer].self_attn._module
        x = got[layer, "attention_norm_output"]
        with torch.no_grad():
            q = module.q_norm(heads(module.q_proj(x), 16))
            k = module.k_norm(heads(module.k_proj(x), 16))
        if layer == 0:
            q, k = rope(model, 0, q, k)
        else:
            k = modeling().nvfp4_fake_quantize(k)
        assert torch.allclose(got[layer, "attention_queries"], q, atol=1e-6)
        assert torch.allclose(got[layer, "attention_keys"], k, atol=1e-6)
    assert model.config.layer_types[:2] == ["sliding_attention", "indexed_attention"]


def test_an_edit_of_layer_1s_keys_reaches_layer_1_only_as_transformers_run_by_hand():
    """Layer 2 attends with the keys layer 1 stored before its rounding: an edit of layer 1's served keys moves
    layer 1's attention, and the logits exactly as transformers' own forward with that edit in layer 1's attention
    call, while layer 2's keys stay layer 1's unedited ones."""
    model = tiny("kolibri1_1")
    clean = read(model, (1, 2), ("attention_keys",))
    edited = clean[1, "attention_keys"].clone()
    edited[:, :, 3:9] *= -2
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[1].self_attn.attention_keys = edited
        later = model.layers[2].self_attn.attention_keys.save()
        logits = model.logits.save()
    assert torch.equal(later, clean[1, "attention_keys"]) and torch.equal(later, clean[2, "attention_keys"])

    # transformers' own forward, on a model nnsight never instrumented (the same weights), with the edit in the call
    hand = tiny_model("kolibri1_1")
    hand.load_state_dict(model._module.state_dict())
    module = modeling()
    eager = module.eager_attention_forward

    def edited_call(attention, query, key, *args, **kwargs):
        return eager(attention, query, edited if attention.layer_idx == 1 else key, *args, **kwargs)

    with torch.no_grad():
        reference = hand(ids()).logits
        module.eager_attention_forward = edited_call
        try:
            by_hand = hand(ids()).logits
        finally:
            module.eager_attention_forward = eager
    assert not torch.allclose(logits, reference, atol=1e-3)
    assert torch.allclose(logits, by_hand, atol=1e-5)


def test_an_edit_of_the_queries_moves_the_scores_not_the_choice():
    """The indexer chose from the queries before the attention function's call: negated queries there negate the
    scores on the chosen keys and leave the choice."""
    model = tiny("kolibri1_1", **BINDING)
    sees = indexer_outputs(model, (1,))[1][0]
    clean = read(model, (1,), ("attention_scores",))[1, "attention_scores"]
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[1].self_attn.attention_queries = -model.layers[1].self_attn.attention_queries
        scores = model.layers[1].self_attn.attention_scores.save()
        probs = model.layers[1].self_attn.attention_probabilities.save()
    assert torch.equal(probs[0] > 0, sees.expand(4, N, N))
    assert torch.allclose(scores[..., sees], -clean[..., sees], atol=1e-5)


def test_rebuilt_sdpa_patterns_apply_the_runs_own_choice():
    needs("kolibri1_1")
    sdpa = attnlens.StandardizedTransformer(
        tiny_model("kolibri1_1", attn_implementation="sdpa", **BINDING),
        tokenizer=char_tokenizer(),
        rebuild_patterns=True,
    )
    sees = indexer_outputs(sdpa, (1,))[1][0]
    probs = trace(sdpa, lambda m: {"p": m.layers[1].self_attn.attention_probabilities})["p"]
    assert not torch.equal(sees, CAUSAL) and torch.equal(probs[0] > 0, sees.expand(4, N, N))
    assert torch.allclose(probs.sum(-1), torch.ones(1, 4, N), atol=1e-5)


def test_support_says_what_each_layer_is():
    model = tiny("kolibri1_1")
    sliding, indexer, reindexer = (model.support(i) for i in range(3))
    assert "sliding window: each query sees its last 4 keys" in sliding.notes["self_attn.attention_probabilities"]
    assert sliding.notes["self_attn.attention_queries"] == "RMS-normalised per head (q_norm), then rotated"
    for support in (indexer, reindexer):
        assert "index_topk=112" in support.notes["self_attn.attention_probabilities"]
        assert "self_attn.indexer.output[0]" in support.notes["self_attn.attention_scores"]
        assert "NoPE" in support.notes["self_attn.attention_queries"]
        assert "NVFP4" in support.notes["self_attn.attention_values"]
    assert "chosen by this layer's indexer" in indexer.notes["self_attn.attention_probabilities"]
    assert "chosen by layer 1's indexer" in reindexer.notes["self_attn.attention_probabilities"]
    assert "layer 2 attends with this layer's too" in indexer.notes["self_attn.attention_keys"]
    assert "layer 1's (kv_source_layers" in reindexer.notes["self_attn.attention_keys"]
    # dense MLPs on mlp_only_layers (0, 1), experts with a shared expert on layer 2
    assert indexer["mlp.mlp_neurons"] is None
    assert "Kolibri1_1Experts" in reindexer["mlp.mlp_neurons"] and "shared_experts" in reindexer["mlp.mlp_neurons"]
    # the KV cache: layer 0's is served, layer 1's is a DynamicIndexedLayer, layer 2 keeps none
    assert sliding["self_attn.attention_cache_keys"] is None
    assert "DynamicIndexedLayer" in indexer["self_attn.attention_cache_keys"]
    assert "layer 2 attends with layer 1's cached keys" in reindexer["self_attn.attention_cache_keys"]
    with pytest.raises(attnlens.Unavailable, match="DynamicIndexedLayer"):
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
            for step in tracer.iter[:2]:
                if step == 1:
                    model.layers[1].self_attn.attention_cache_keys.save()
    assert "Kolibri1_1Config" in model.family.vllm.refusal


def test_the_cache_class_the_reason_names_is_the_one_generate_builds():
    """The reason is the cache class's: generate's DynamicCache holds a DynamicIndexedLayer for layer 1, which
    attnlens's cache values refuse, a DynamicSlidingWindowLayer for layer 0, and nothing for layer 2."""
    from transformers import DynamicCache

    from attnlens.locations.cache import SUPPORTED

    cache = DynamicCache(config=tiny("kolibri1_1").config)
    names = [type(layer).__name__ for layer in cache.layers]
    assert names == ["DynamicSlidingWindowLayer", "DynamicIndexedLayer", "DummyLayer"]
    assert names[1] not in SUPPORTED
