"""Head summaries from the queries and keys, in chunks, equal the same summaries of the full eager pattern."""

import json

import pytest
import torch
from conftest import ALL_CASES, PROMPT, tiny

import attnlens
from attnlens import heads
from attnlens.models import char_tokenizer, tiny_model

LENGTH, SEQUENCES = 12, 3  # BOS + 12 + 12 = 25 tokens: past the tiny sliding windows (4)
PROMPTS = [PROMPT, "Hi", "The cat sat on the mat"]
ROWS = [-1, 0, 1]
TOLERANCE = dict(atol=2e-5, rtol=1e-5)  # float32 sums of up to 25 terms per row; the pattern rounds once more


def reference(patterns, rows=(), top_k=3, repeated=False, causal=True):
    """The summaries of full patterns ([heads, query, key] per text), computed the plain way; a row of a causal
    pattern ranks the keys up to its own, of a bidirectional one every key."""
    patterns = [p.float() for p in patterns]
    out = {
        "entropy": torch.cat([torch.special.entr(p).sum(-1) for p in patterns], dim=1).mean(1),
        "sink": torch.cat([p[..., 0] for p in patterns], dim=1).mean(1),
        "last": torch.cat([p[..., -1] for p in patterns], dim=1).mean(1),  # a bidirectional model's only
    }
    # BOS + R + R, R of LENGTH: row i of the second copy (LENGTH + 1 .. 2 LENGTH) and its earlier occurrence i - LENGTH
    second = range(LENGTH + 1, 2 * LENGTH + 1)
    stripes = {
        "previous": [(i, i - 1) for i in range(1, 2 * LENGTH + 1)],
        "duplicate": [(i, i - LENGTH) for i in second],
        "induction": [(i, i - LENGTH + 1) for i in second],
        "next": [(i, i + 1) for i in range(2 * LENGTH)],  # a bidirectional model's only
    }
    for name, cells in stripes.items() if repeated else ():
        out[name] = torch.stack([p[:, i, j] for p in patterns for i, j in cells], dim=1).mean(1)
    seen = (lambda p, row: row % p.shape[1] + 1) if causal else (lambda p, row: p.shape[2])
    out["top"] = [
        [p[:, row % p.shape[1], : seen(p, row)].topk(min(top_k, seen(p, row))) for row in rows] for p in patterns
    ]
    return out


def summarisable(model):
    return [layer for layer in range(model.num_layers) if heads.why_not(model, layer) is None]


@pytest.mark.parametrize("case", ALL_CASES + attnlens.models.tiny_cases(causal=False))
def test_summaries_equal_the_full_pattern(case):
    """Every family, the encoders' too (rows that see every key, ModernBERT's bands both ways): the chunked summaries
    equal those of the eager `attention_probabilities` on every layer that serves queries and keys; layers that don't
    (linear attention, sink logits, DeBERTa's position terms) are skipped with the reason."""
    model = tiny(case)
    layers = summarisable(model)
    for layer in set(range(model.num_layers)) - set(layers):
        reason = heads.why_not(model, layer)
        assert "unavailable" in reason or "sink logit" in reason or "no softmax pattern" in reason, reason
    if not layers:
        with pytest.raises(attnlens.Unavailable, match="no layer"):
            heads.head_summaries(model, length=LENGTH, sequences=SEQUENCES)
        pytest.skip(f"no layer of {case} can be summarised: {heads.why_not(model, 0)}")
    found = heads.head_summaries(
        model, PROMPTS, length=LENGTH, sequences=SEQUENCES, rows=ROWS, chunk_rows=4, batch_size=2, progress=False
    )
    assert found.layers == layers and sorted(found.skipped) == sorted(set(range(model.num_layers)) - set(layers))

    repeats = heads.repeated_tokens(model, LENGTH, SEQUENCES, seed=0)
    assert repeats.shape == (SEQUENCES, 1 + 2 * LENGTH)
    assert torch.equal(repeats[:, 1 : 1 + LENGTH], repeats[:, 1 + LENGTH :]) and (repeats[:, 0] == 1).all()
    on_repeats = attnlens.capture_attention(model, repeats, layers, keep="probs", progress=False)
    causal = model.family.score_function().causal(model.config)
    on_prompts = attnlens.capture_attention(model, PROMPTS, layers, keep="probs", progress=False)
    for layer in layers:
        want = reference([r[layer]["probs"] for r in on_repeats], repeated=True)
        assert ("next" in found.metrics) == (not causal) == ("last" in found.metrics)
        for metric in [metric for metric in heads.TARGETED if metric in found.metrics]:
            assert torch.allclose(found.get(metric, layer), want[metric], **TOLERANCE), (metric, layer)
        want = reference([r[layer]["probs"] for r in on_prompts], rows=ROWS, causal=causal)
        for metric in [metric for metric in heads.ON_TEXT if metric in found.metrics]:
            assert torch.allclose(found.get(metric, layer), want[metric], **TOLERANCE), (metric, layer)
        entries = iter(found.top[layer])
        for p, per_row in enumerate(want["top"]):
            ids = model.tokenizer(PROMPTS[p]).input_ids
            for j, (weights, keys) in enumerate(per_row):
                entry = next(entries)
                assert (entry["prompt"], entry["row"]) == (p, ROWS[j] % len(PROMPTS[p]))
                for h, listed in enumerate(entry["keys"]):
                    got = torch.tensor([w for _, _, w in listed])
                    assert torch.allclose(got, weights[h][weights[h] > 0], atol=1e-5), (layer, p, j, h)
                    assert [position for position, _, _ in listed] == keys[h][weights[h] > 0].tolist()
                    assert [text for _, text, _ in listed] == [model.tokenizer.decode([ids[k]]) for k, _, _ in listed]
        assert next(entries, None) is None


def test_rebuilt_sdpa_model_gives_the_same_summaries():
    """Only the queries and keys are read, so an sdpa model (patterns never formed) summarises as eager does."""
    sdpa = attnlens.StandardizedTransformer(
        tiny_model("gemma3"), tokenizer=char_tokenizer(), attn_implementation="sdpa"
    )
    assert sdpa.support(1)["self_attn.attention_probabilities"] is not None
    a = heads.head_summaries(sdpa, PROMPTS, length=LENGTH, sequences=SEQUENCES, progress=False)
    b = heads.head_summaries(tiny("gemma3"), PROMPTS, length=LENGTH, sequences=SEQUENCES, progress=False)
    assert (
        a.metrics
        == b.metrics
        == [metric for metric in heads.METRICS if metric not in (*heads.BIDIRECTIONAL, *heads.ON_IMAGES)]
    )
    for metric in a.metrics:
        for layer in a.layers:
            assert torch.allclose(a.get(metric, layer), b.get(metric, layer), atol=1e-5), (metric, layer)


def test_summarize_never_forms_the_full_pattern():
    model = tiny("llama")
    shapes = []
    score = heads.score_function(model.layers[1].self_attn)
    queries, keys = torch.randn(1, 4, 10, 16), torch.randn(1, 2, 10, 16)

    def recording(q, k):
        shapes.append((q.shape[2], k.shape[2]))
        return score(q, k)

    chunked = heads.summarize(recording, queries, keys, chunk_rows=4, top_rows=[-1], top_k=2)
    assert shapes == [(4, 4), (4, 8), (2, 10)]  # rows 4 at a time, each against the keys it can see
    whole = heads.summarize(score, queries, keys, top_rows=[-1], top_k=2)
    for name in whole:
        assert torch.allclose(chunked[name].float(), whole[name].float(), atol=1e-6), name
    with pytest.raises(ValueError, match="at most the row's own position"):
        heads.summarize(score, queries, keys, targets={"ahead": torch.arange(10) + 1})


def test_summarize_on_a_decode_step():
    """Queries fewer than keys (a decode step): row i sits at key offset + i."""
    model = tiny("mistral")  # sliding window 4
    score = heads.score_function(model.layers[0].self_attn)
    queries, keys = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 9, 16)
    out = heads.summarize(score, queries, keys, targets={"previous": torch.tensor([6, 7])}, top_rows=[0], top_k=9)
    probs = score(queries, keys).softmax(-1)
    assert torch.allclose(out["previous"][0], probs[0, :, [0, 1], [6, 7]].sum(-1), atol=1e-6)
    assert (out["top_keys"][0, :, 0, :4].sort(-1).values == torch.arange(4, 8)).all()  # the window of row 0
    assert (out["top_weights"][0, :, 0, 4:] == 0).all()


def test_repeated_tokens_leave_out_every_special_id():
    """The random halves draw no special id: the tokenizer's and the config's, an end-of-sequence list included."""
    model = tiny("llama")
    config = model.access.config
    eos, config.eos_token_id = config.eos_token_id, [5, 6]  # several end-of-sequence ids, as some checkpoints give
    try:
        drawn = heads.repeated_tokens(model, length=60, count=40, seed=0)[:, 1:]
    finally:
        config.eos_token_id = eos
    special = {5, 6, config.bos_token_id, config.pad_token_id, *char_tokenizer().all_special_ids} - {None}
    assert not set(drawn.unique().tolist()) & special
    assert len(drawn.unique()) > config.vocab_size // 2  # drawn from the rest of the vocabulary


def test_result_formats():
    model = tiny("llama")
    found = heads.head_summaries(model, "Hello world", length=LENGTH, sequences=SEQUENCES, top_k=2, progress=False)
    rows = found.to_rows()
    causal_metrics = [metric for metric in heads.METRICS if metric not in (*heads.BIDIRECTIONAL, *heads.ON_IMAGES)]
    assert len(rows) == 3 * 4 and set(rows[0]) == {"layer", "head", *causal_metrics, "top"}
    assert rows[0]["top"][0]["row"] == len("Hello world") - 1
    assert all(len(keys) <= 2 for row in rows for keys in [row["top"][0]["keys"]])
    csv_lines = found.to_csv().splitlines()
    assert csv_lines[0] == "layer,head," + ",".join(causal_metrics) + ",top" and len(csv_lines) == 13
    parsed = json.loads(found.to_json())
    assert parsed["heads"] == json.loads(json.dumps(rows)) and set(parsed["metrics"]) == set(causal_metrics)
    assert "induction" in str(found) and found.ranked("induction", 2)[0] in [(r["layer"], r["head"]) for r in rows]
    best = max(rows, key=lambda r: r["induction"])
    assert found.ranked("induction", 1) == [(best["layer"], best["head"])]


def test_errors_name_what_was_wrong():
    model = tiny("llama")
    with pytest.raises(IndexError, match=r"layer 5 is out of range.*\[0, 3\)"):
        heads.head_summaries(model, layers=[5])
    with pytest.raises(IndexError, match="row 30 is out of range"):
        heads.head_summaries(model, "Hello", rows=30, length=LENGTH)
    with pytest.raises(ValueError, match="longer than the model's 128 positions"):
        heads.head_summaries(model, length=100)
    summarised = heads.head_summaries(model, length=LENGTH, sequences=1, layers=[1], progress=False)
    with pytest.raises(KeyError, match="not a head summary"):
        summarised.get("nope", 1)
    with pytest.raises(KeyError, match="measured on bidirectional models only"):
        summarised.get("next", 1)
    hybrid = tiny("qwen3_next")  # layer 0 is linear attention: no queries and keys
    with pytest.raises(attnlens.Unavailable, match="layer 0 on Qwen3Next"):
        heads.head_summaries(hybrid, layers=[0])


@pytest.mark.real
def test_top_induction_heads_matter_on_smollm2():
    """On SmolLM2 the heads with the highest induction scores carry in-context copying: ablating them raises the loss
    on the repeated half far more than ablating as many random heads (several seeded draws)."""
    model = attnlens.models.smollm2()
    found = heads.head_summaries(model, length=40, sequences=4, progress=False)
    held_out = heads.repeated_tokens(model, 40, 4, seed=1)
    base = heads.repeat_loss(model, held_out, 40)
    top = heads.repeat_loss(model, held_out, 40, found.ranked("induction", 5))
    random_rises = [
        heads.repeat_loss(model, held_out, 40, heads.random_heads(found, 5, seed)) - base for seed in range(3)
    ]
    assert base < heads.repeat_loss(model, held_out, 40, copy=1) / 2  # SmolLM2 copies the repeated half
    assert top - base > 2 * max(random_rises), (base, top, random_rises)
