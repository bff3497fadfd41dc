"""Qwen4Exp, Qwen4ExpText (attnlens/families/qwen4_exp.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, needs, tiny
from identities import N, ids, trace

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.qwen4_exp import sums_masks
from attnlens.models import char_tokenizer, tiny_model


@pytest.mark.parametrize("case", ["qwen4_exp_text", "qwen4_exp"])
def test_qwen4_exp_streams_are_the_flat_residual_per_stream(case):
    model = tiny(case)
    count, hidden = 2, model.config.get_text_config().hidden_size
    got = trace(
        model,
        lambda m: {
            "e": m.embeddings,
            "x0": m.layers[0].layer_input,
            "o": m.layers[2].layer_output,
            "f": m.final_norm_output,
        },
    )
    assert got["x0"].shape == (1, N, count, hidden)
    # the model repeats the embeddings into every stream before the first block
    assert torch.equal(got["x0"], got["e"][:, :, None].expand(-1, -1, count, -1))
    mixer = model._module.get_submodule(model.family.final_norm)
    with torch.no_grad():
        assert torch.allclose(mixer(got["o"].flatten(-2)), got["f"], atol=1e-6)


def test_qwen4_exp_an_edit_of_a_stream_lands():
    model = tiny("qwen4_exp_text")
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[1].layer_input[:, :, 1] = 0
        inside = model.layers[1].attn_hyper_connection.input.save()
    assert (inside.unflatten(-1, (2, -1))[:, :, 1] == 0).all() and (inside.unflatten(-1, (2, -1))[:, :, 0] != 0).any()


def test_qwen4_exp_the_indexer_masks_the_keys_it_does_not_choose():
    needs("qwen4_exp_text")
    # a budget of 4 keys in blocks of 2: each query sees the 2 best blocks among its complete ones, plus its tail
    model = attnlens.StandardizedTransformer(
        tiny_model("qwen4_exp_text", indexer_budget=4), tokenizer=char_tokenizer(), attn_implementation="eager"
    )
    assert failures(model, read_everything(model, "Hi"), 1) == []  # 2 tokens: the budget does not bind
    got = trace(
        model,
        lambda m: {
            "q": m.layers[1].self_attn.attention_queries,
            "k": m.layers[1].self_attn.attention_keys,
            "s": m.layers[1].self_attn.attention_scores,
            "p": m.layers[1].self_attn.attention_probabilities,
        },
    )
    seen = got["p"][0, 0] > 0
    assert (seen == (got["p"][0] > 0)).all()  # one choice for every head
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert not (seen & ~causal).any()
    counts = seen.sum(-1)
    # at most 2 blocks of 2 and a tail of 1; every visible key up to 5, fewer after
    assert counts.max() == 5 and (counts[:5] == torch.arange(1, 6)).all()
    assert (counts[5:] < torch.arange(6, N + 1)).all()
    hidden = got["s"][0, :, ~seen]
    future = got["s"][0, :, ~causal]
    assert ((hidden == torch.finfo(torch.float32).min) | (hidden == -torch.inf)).all()
    assert (future == (-torch.inf if sums_masks() else torch.finfo(torch.float32).min)).all()
    attn = model.layers[1].self_attn
    rebuilt = model.family.score_function().scores(attn.heads, model.config, got["q"], got["k"], 1)
    assert torch.allclose(rebuilt[0][:, seen], got["s"][0][:, seen], atol=1e-5)
    assert "indexer_budget=4" in model.support(1).notes["self_attn.attention_probabilities"]


def test_qwen4_exp_ple_layers_add_their_branch_before_the_hyper_connection():
    needs("qwen4_exp_text")
    # PLE on layer 0 (ple_layer_ids are 1-based and must be linear-attention layers)
    module = tiny_model(
        "qwen4_exp_text", ple_layer_ids=[1], ple_embed_dim=32, ngram_vocab_size_base=1000, split_ngram_parts=1
    )
    model = attnlens.StandardizedTransformer(module, tokenizer=char_tokenizer(), attn_implementation="eager")
    got = trace(
        model,
        lambda m: {
            "x": m.layers[0].layer_input,
            "a": m.layers[0].self_attn.attention_output,
            "m": m.layers[0].layer_mid,
        },
    )
    block = module.model.layers[0]
    with torch.no_grad():
        flat = got["x"].flatten(-2)
        flat = flat + block.ple(flat, ids(), None)
        _, streams, weights = block.attn_hyper_connection(flat)
        mid = streams + (got["a"].unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
    assert torch.allclose(mid.unflatten(-1, (2, -1)), got["m"], atol=1e-5)
    # the family's identity (without the branch) does not hold there, and support() says why
    with torch.no_grad():
        plain = model.family.identities.residual_add(block, "attention", got["x"], got["a"])
    assert not torch.allclose(plain, got["m"], atol=1e-3)
    assert "PLE" in model.support(0).notes["layer_mid"] and "PLE" not in model.support(1).notes["layer_mid"]


def test_qwen4_exp_composite_serves_its_language_model_as_the_text_model():
    needs("qwen4_exp")
    text = tiny("qwen4_exp_text")
    composite = attnlens.StandardizedTransformer(tiny_model("qwen4_exp", checkpoint=True), tokenizer=char_tokenizer())
    assert composite.family.layers == "model.language_model.layers"
    assert (
        composite.support(1).notes["self_attn.attention_probabilities"]
        == text.support(1).notes["self_attn.attention_probabilities"]
    )
    assert "vision tower" in composite.support(0).notes["embeddings"]
    # the same text weights give the same values (a fresh composite: the session's tiny models stay unedited)
    module = tiny_model("qwen4_exp", checkpoint=True)
    inner = text._module.state_dict()
    module.model.language_model.load_state_dict(
        {k.removeprefix("model."): v for k, v in inner.items() if k.startswith("model.")}
    )
    module.lm_head.load_state_dict(text._module.lm_head.state_dict())
    composite = attnlens.StandardizedTransformer(module, tokenizer=char_tokenizer(), attn_implementation="eager")
    a = trace(text, lambda m: {"p": m.layers[1].self_attn.attention_probabilities, "l": m.logits})
    b = trace(composite, lambda m: {"p": m.layers[1].self_attn.attention_probabilities, "l": m.logits})
    assert torch.allclose(a["p"], b["p"], atol=1e-6) and torch.allclose(a["l"], b["l"], atol=1e-5)


def test_qwen4_exp_an_indexed_layers_cache_is_refused_with_its_reason_where_the_read_would_be():
    """Its indexed layers' cache is transformers' DynamicIndexedLayer: support() says so, and a read under generate
    raises that reason (before this, support() said served and the read raised from the cache's code)."""
    model = tiny("qwen4_exp_text")
    indexed = next(layer for layer in range(model.num_layers) if model.family.indexed(model.config, layer))
    reason = model.support(indexed)["self_attn.attention_cache_keys"]
    assert reason and "DynamicIndexedLayer" in reason
    with pytest.raises(attnlens.Unavailable, match="DynamicIndexedLayer"):
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
            for _ in tracer.iter[1:2]:
                model.layers[indexed].self_attn.attention_cache_keys.save()
