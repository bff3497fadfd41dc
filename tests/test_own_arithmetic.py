"""Families whose attention does its own arithmetic (GPT-Neo, Bloom, MPT, Falcon up to transformers 5.24;
GPT-NeoX-Japanese, JetMoE): the score functions bit for bit, edits through views and copies, decode steps.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import N, close, saved_for, trace

import attnlens
from attnlens import family_for
from attnlens.families.falcon import own_arithmetic
from attnlens.models import char_tokenizer, tiny_model

ROUTED_AND_BIASED = ("gpt_neox_japanese", "jetmoe")


@pytest.mark.parametrize("case", ROUTED_AND_BIASED)
def test_score_function_is_exact_on_routed_and_biased_heads(case):
    model = tiny(case)
    saved = saved_for(case)
    for layer in range(model.num_layers):
        attn = model.layers[layer].self_attn
        q, k = saved[(layer, "attention_queries")], saved[(layer, "attention_keys")]
        assert torch.equal(
            model.family.score_function().scores(attn.heads, model.config, q, k, layer),
            saved[(layer, "attention_scores")],
        ), layer


@pytest.mark.parametrize("case", ROUTED_AND_BIASED)
def test_decode_steps_see_the_whole_cache_on_routed_and_biased_heads(case):
    model = tiny(case)
    layer = 1
    attn = model.layers[layer].self_attn
    names = (
        "attention_queries",
        "attention_keys",
        "attention_values",
        "attention_scores",
        "attention_probabilities",
        "attention_head_outputs",
    )
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
        steps = list().save()
        for _ in tracer.iter[:2]:
            steps.append(tuple(getattr(attn, name) for name in names))
    groups = attn.num_heads // attn.num_kv_heads
    for step, (q, k, v, scores, probs, heads) in enumerate(steps):
        rows = 1 if step else N
        assert q.shape[2] == rows and k.shape[2] == v.shape[2] == N + step and probs.shape[2:] == (rows, N + step)
        assert k.shape[1] == attn.num_kv_heads
        assert torch.equal(model.family.score_function().scores(attn.heads, model.config, q, k, layer), scores)
        assert close((probs @ model.family.score_function().repeat_kv(v, groups)).transpose(1, 2), heads)


CASES = ("gpt_neo", "bloom", "mpt", "falcon", "falcon:multihead", "falcon:new_architecture", "falcon:alibi")


ALIBI = ("bloom", "mpt", "falcon:alibi")


def attention_reads(layer):
    def read(model):
        attn = model.layers[layer].self_attn
        return {"q": attn.attention_queries, "k": attn.attention_keys, "s": attn.attention_scores}

    return read


@pytest.mark.parametrize("case", CASES)
def test_score_function_is_exact(case):
    model = tiny(case)
    saved = saved_for(case)
    for layer in range(model.num_layers):
        module = model.layers[layer].self_attn._module
        q, k = saved[(layer, "attention_queries")], saved[(layer, "attention_keys")]
        scores = model.family.score_function().scores(
            model.family.sizes.geometry(module, model.family), model.config, q, k, layer
        )
        assert torch.equal(scores, saved[(layer, "attention_scores")]), layer


@pytest.mark.parametrize("case", CASES)
def test_score_function_is_exact_with_left_padding(case):
    # ALiBi positions count real tokens only (Bloom, Falcon), padding keys are masked: the key mask must say so.
    model = tiny(case)
    tokenizer = char_tokenizer()
    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPT, "Hi there"], return_tensors="pt", padding=True)
    assert not batch.attention_mask.all()
    layer = 1
    got = trace(model, attention_reads(layer), dict(batch))
    module = model.layers[layer].self_attn._module
    rebuilt = model.family.score_function().scores(
        model.family.sizes.geometry(module, model.family),
        model.config,
        got["q"],
        got["k"],
        layer,
        key_mask=batch.attention_mask,
    )
    assert torch.equal(rebuilt, got["s"])


@pytest.mark.parametrize("case", CASES)
def test_score_function_is_exact_in_bfloat16(case):
    # dtypes differ per family: GPT-Neo upcasts, MPT's float32 bias and Falcon-ALiBi's upcast (transformers 5.24's own
    # arithmetic) promote the scores, masks take the model dtype's minimum
    model = attnlens.StandardizedTransformer(tiny_model(case).to(torch.bfloat16), tokenizer=char_tokenizer())
    got = trace(model, attention_reads(1))
    upcast = ("gpt_neo", "mpt", "falcon:alibi") if own_arithmetic() else ("gpt_neo", "mpt")
    expected = torch.float32 if case in upcast else torch.bfloat16
    assert got["s"].dtype == expected
    heads = model.layers[1].self_attn.heads
    assert torch.equal(model.family.score_function().scores(heads, model.config, got["q"], got["k"], 1), got["s"])


@pytest.mark.parametrize("case", ALIBI)
def test_score_function_is_exact_with_six_heads(case):
    # 6 is not a power of two: Bloom/Falcon add odd powers of the next base, MPT interleaves its slopes.
    model = tiny(case, num_attention_heads=6, hidden_size=48)
    got = trace(model, attention_reads(0))
    assert got["q"].shape[1] == 6
    heads = model.layers[0].self_attn.heads
    assert torch.equal(model.family.score_function().scores(heads, model.config, got["q"], got["k"], 0), got["s"])


@pytest.mark.parametrize("case", ["gpt_neo", "bloom", "falcon:alibi"])
def test_head_outputs_view_takes_in_place_edits_and_assignment(case):
    model = tiny(case)
    attn = model.layers[1].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_head_outputs[:, :, 2] = 0
        in_place = attn.attention_premix.save()
    with torch.no_grad(), model.trace(PROMPT):
        heads = attn.attention_head_outputs
        attn.attention_head_outputs = heads * 0 + 1.5
        assigned = attn.attention_premix.save()
    assert (in_place[..., 32:48] == 0).all() and (in_place[..., 48:] != 0).all()
    assert (assigned == 1.5).all()


@pytest.mark.parametrize("case", ["bloom", "mpt", "gpt_neo"])
def test_key_edits_land_in_the_scores(case):
    """Keys are (views of) what the arithmetic uses: Bloom's [batch*heads] keys, MPT's transposed ones, `_attn`'s."""
    model = tiny(case)
    layer = 1
    attn = model.layers[layer].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        q = attn.attention_queries.save()
        keys = attn.attention_keys
        keys[:, 0] *= 0
        keys = keys.save()
        scores = attn.attention_scores.save()
    assert (keys[:, 0] == 0).all()
    module = attn._module
    assert torch.equal(
        model.family.score_function().scores(
            model.family.sizes.geometry(module, model.family), model.config, q, keys, layer
        ),
        scores,
    )
    assert not torch.equal(scores, saved_for(case)[(layer, "attention_scores")])


@pytest.mark.parametrize(("case", "options"), [(case, {}) for case in CASES] + [("mpt", {"use_cache": True})])
def test_decode_steps_see_the_whole_cache(case, options):
    # MptConfig defaults to use_cache=False: each step then recomputes every position
    model = tiny(case, **options)
    layer = 1
    attn = model.layers[layer].self_attn
    names = (
        "attention_queries",
        "attention_keys",
        "attention_values",
        "attention_scores",
        "attention_probabilities",
        "attention_head_outputs",
    )
    order = model.order(layer)
    in_order = sorted(names, key=lambda name: order[f"self_attn.{name}"])  # MPT reads its values after the pattern
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
        steps = list().save()
        for _ in tracer.iter[:2]:
            read = {name: getattr(attn, name) for name in in_order}
            steps.append(tuple(read[name] for name in names))
    groups = attn.num_heads // attn.num_kv_heads
    for step, (q, k, v, scores, probs, heads) in enumerate(steps):
        rows = 1 if step and model.config.use_cache else N + step
        assert q.shape[2] == rows and k.shape[2] == v.shape[2] == N + step and probs.shape[2:] == (rows, N + step)
        assert torch.equal(model.family.score_function().scores(attn.heads, model.config, q, k, layer), scores)
        assert close((probs @ v.repeat_interleave(groups, dim=1)).transpose(1, 2), heads)
    # the step's keys extend the prefill's (recomputed without a cache: equal up to rounding)
    assert close(steps[1][1][:, :, :N], steps[0][1])


@pytest.mark.parametrize(
    ("case", "reads"),
    [
        ("gpt_neo", "read in GPTNeoSelfAttention._attn, which the 'flash_attention_2' attention never calls"),
        (
            "falcon",
            "the 'flash_attention_2' attention is FalconFlashAttention2, whose own forward attnlens does not read",
        ),
    ],
)
def test_flash_attention_is_reported_not_misread(case, reads):
    # flash-attn needs a GPU: the reasons are computed from the config alone, before anything runs
    model = tiny_model(case)
    model.config._attn_implementation = "flash_attention_2"
    reasons = family_for(case).unavailable(model.config, 1)
    if case == "falcon" and not own_arithmetic():  # FalconAttention calls flash through the interface: read there
        assert set(reasons) & {"attention_queries", "attention_keys", "attention_values"} == set()
        assert reasons["attention_scores"].startswith("read inside transformers' eager attention function")
        return
    for name in ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs"):
        assert reasons[name].startswith(reads), name
    assert "attention_premix" not in reasons and "attention_output" not in reasons
