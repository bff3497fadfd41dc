"""Patterns without eager (rebuild_patterns=True) and long contexts (row and head subsets, chunks of rows)."""

import pytest
import torch
from conftest import ALL_CASES, PROMPT, tiny

import attnlens
from attnlens import rebuild
from attnlens.models import char_tokenizer, tiny_model

PROMPTS = ["Hello world, again", "Hi there"]
PATTERNS = ("attention_scores", "attention_probabilities")
_rebuilding = {}


def rebuilding(case):
    """The tiny model of `case` under sdpa with rebuild_patterns=True (skips families transformers runs eager only)."""
    if case not in _rebuilding:
        try:
            _rebuilding[case] = attnlens.StandardizedTransformer(
                tiny_model(case), tokenizer=char_tokenizer(), attn_implementation="sdpa", rebuild_patterns=True
            )
        except ValueError as error:  # "does not support an attention implementation through ... sdpa"
            _rebuilding[case] = str(error).split(".")[0]
    if isinstance(_rebuilding[case], str):
        pytest.skip(_rebuilding[case])
    return _rebuilding[case]


def rebuilt_layers(model):
    return [
        layer
        for layer in range(model.num_layers)
        if all(model.support(layer)[f"self_attn.{name}"] is None for name in PATTERNS)
    ]


def test_the_default_stays_honest():
    plain = attnlens.models.tiny("llama", attn_implementation="sdpa")
    assert not plain.rebuild_patterns
    assert "never forms it" in plain.support(1)["self_attn.attention_probabilities"]
    with pytest.raises(attnlens.Unavailable):
        attnlens.capture_attention(plain, PROMPT, [1])


def test_support_says_rebuilt_read_only():
    model = rebuilding("llama")
    report = model.support(1)
    assert report["self_attn.attention_probabilities"] is None and report["self_attn.attention_scores"] is None
    assert report.notes["self_attn.attention_probabilities"].startswith("rebuilt, read-only")
    eager = tiny("llama")
    eager.rebuild_patterns = True  # eager forms the pattern itself: nothing is rebuilt, nothing noted
    try:
        assert "self_attn.attention_probabilities" not in eager.support(1).notes
    finally:
        eager.rebuild_patterns = False
    with pytest.raises(attnlens.EditError, match="read-only"):
        with model.trace(PROMPT):
            model.layers[1].self_attn.attention_scores = torch.zeros(1)


#: How far a rebuilt pattern may be from an eager model's, by dtype: sdpa and eager compute the earlier layers in
#: another order, so the queries and keys already differ (docs/patterns-without-eager.md has the measurements).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_rebuilt_patterns_per_dtype(dtype):
    """Exact against the eager function on the same queries and keys; within the dtype's tolerance of eager."""
    prompt = "When Mary and John went to the store, John gave a drink to"
    models = {}
    for implementation in ("sdpa", "eager"):
        inner = tiny_model("llama", attn_implementation=implementation).to(dtype)
        models[implementation] = attnlens.StandardizedTransformer(
            inner, tokenizer=char_tokenizer(), attn_implementation=implementation, rebuild_patterns=True
        )
    got = {}
    for implementation, model in models.items():
        attn = model.layers[1].self_attn
        with torch.no_grad(), model.trace(prompt):
            got[implementation] = (
                attn.attention_queries.save(),
                attn.attention_keys.save(),
                attn.attention_probabilities.save(),
            )
    queries, keys, rebuilt = got["sdpa"]
    sdpa = models["sdpa"]
    scores = sdpa.family.score_function().scores(sdpa.layers[1].self_attn.heads, sdpa.config, queries, keys, 1)
    assert rebuilt.dtype == dtype
    assert torch.equal(rebuilt, scores.softmax(-1, dtype=torch.float32).to(dtype))
    assert (rebuilt.float() - got["eager"][2].float()).abs().max() <= TOLERANCE[dtype]


@pytest.mark.parametrize("case", ALL_CASES)
def test_rebuilt_patterns_equal_eager(case):
    """Every family sdpa can run: rebuilt scores and pattern (in a trace, and captured from a padded batch) equal the
    eager ones; where the family's pattern cannot be rebuilt, support() says why."""
    model, eager = rebuilding(case), tiny(case)
    layers = rebuilt_layers(model)
    eager_layers = [
        layer for layer in range(eager.num_layers) if eager.support(layer)["self_attn.attention_probabilities"] is None
    ]
    for layer in sorted(set(eager_layers) - set(layers)):
        assert "rebuild_patterns cannot rebuild it here" in model.support(layer)["self_attn.attention_probabilities"]
    if not layers:
        pytest.skip(model.support(eager_layers[0])["self_attn.attention_probabilities"])
    rebuilt = attnlens.capture_attention(model, PROMPTS, layers, keep=("scores", "probs"))
    expected = attnlens.capture_attention(eager, PROMPTS, layers, keep=("scores", "probs"))
    for got, want in zip(rebuilt, expected):
        for layer in layers:
            # 1e-5: the earlier sdpa layers' last bits, scaled by muP-style multipliers (Falcon-H1, Granite: 4.7e-6)
            assert torch.allclose(got[layer]["probs"], want[layer]["probs"], atol=1e-5), layer
            visible = ~attnlens.masked(want[layer]["scores"])
            assert torch.equal(visible, ~attnlens.masked(got[layer]["scores"]))
            # sdpa and eager layers before this one differ in the last bits; Granite's multipliers amplify them
            assert torch.allclose(
                got[layer]["scores"][visible], want[layer]["scores"][visible], atol=1e-4, rtol=1e-4
            ), layer


@pytest.mark.parametrize("case", ["llama", "mistral"])
def test_rebuilt_values_read_in_a_trace(case):
    """The envoy path: `attn.attention_probabilities` in a trace on a padded batch, every row (padding rows too)."""
    model, eager = rebuilding(case), tiny(case)
    got, want = [], []
    for source, out in ((model, got), (eager, want)):
        with torch.no_grad(), source.trace(PROMPTS):
            saved = list().save()
            for layer in source.layers:
                saved.append(layer.self_attn.attention_scores)
                saved.append(layer.self_attn.attention_probabilities)
        out.extend(saved)
    for rebuilt, real in zip(got, want):
        assert torch.equal(attnlens.masked(rebuilt), attnlens.masked(real))
        assert torch.allclose(rebuilt, real, atol=1e-5, rtol=1e-4)


def test_a_sink_family_is_not_rebuilt_and_says_why():
    """GPT-OSS's softmax takes a sink logit per head; transformers runs it eager only, so ask as if it ran sdpa."""
    model = attnlens.models.tiny("gpt_oss")
    model.config._attn_implementation = "sdpa"  # nothing runs: only the reasons are asked for
    reasons = model.family.unavailable(model.config, 1)
    assert "sink logit" in rebuild.why_not(model.access, 1, reasons)
    assert "sink logit" in rebuild.adjust(model.access, 1, reasons)["attention_probabilities"]


# --- long contexts ----------------------------------------------------------------------------------------------------


def test_chunked_and_subset_patterns_equal_the_full_patterns_slices():
    model = rebuilding("gemma3")  # sliding windows shorter than the prompt on layers 0 and 2
    full = attnlens.capture_attention(model, PROMPTS, [0, 1, 2], keep=("scores", "probs"))
    chunked = attnlens.capture_attention(model, PROMPTS, [0, 1, 2], keep=("scores", "probs"), chunk_rows=3)
    rows, heads = [-1, 0, 5, 6, 7, 1], [3, 1]
    subset = attnlens.capture_attention(
        model, PROMPTS, [0, 1, 2], keep=("scores", "probs"), rows=rows, heads=heads, chunk_rows=2
    )

    def same(a, b):  # a chunk's matmul may round its last bit differently; the mask must be identical
        return torch.equal(attnlens.masked(a), attnlens.masked(b)) and torch.allclose(a, b, atol=1e-6, rtol=1e-6)

    for whole, pieces, part in zip(full, chunked, subset):
        for layer in whole:
            for kind in ("scores", "probs"):
                assert same(pieces[layer][kind], whole[layer][kind])
                length = whole[layer][kind].shape[-1]
                index = [row % length for row in rows]
                assert same(part[layer][kind], whole[layer][kind][heads][:, index])


def test_subsets_never_form_the_full_matrix(monkeypatch):
    model = rebuilding("llama")
    shapes = []
    scores = model.family.ScoreFunction.scores

    def recording(self, heads, config, queries, keys, layer, key_mask=None):
        shapes.append((queries.shape[2], keys.shape[2]))
        return scores(self, heads, config, queries, keys, layer, key_mask)

    monkeypatch.setattr(model.family.ScoreFunction, "scores", recording)
    attnlens.capture_attention(model, PROMPT, [0, 1, 2], keep="probs", rows=-1)
    assert shapes == [(1, 18)] * 3  # the last row of each layer, against every key
    shapes.clear()
    attnlens.capture_attention(model, PROMPT, [1], keep="probs", chunk_rows=4)
    assert [q for q, _ in shapes] == [4, 4, 4, 4, 2]  # the full pattern, four query rows at a time
    assert [k for _, k in shapes] == [4, 8, 12, 16, 18]  # each chunk only against the keys it can see
