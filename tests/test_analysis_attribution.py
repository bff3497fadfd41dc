"""Direct attribution adds up: on every family's tiny model, the pieces sum to the run's logit difference, and each
split layer's head pieces to its attention update; where a family cannot be decomposed, `unavailable` says so first."""

import pytest
import torch
from conftest import ALL_CASES, PROMPT, tiny

import attnlens
from attnlens.analysis import attribution, unavailable
from attnlens.analysis.attribution import final_softcap
from attnlens.analysis.reasons import model_reason, split_reason

ROWS = [-1, 5]


def close(a, b):
    """float32 sums of a few hundred terms: 1e-4 relative to the logits' size."""
    return float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))


def run_logits(model):
    with torch.no_grad(), model.trace(PROMPT):
        logits = model.logits.save()
    cap = final_softcap(model)
    return logits[0] if cap is None else cap * torch.atanh(logits[0] / cap)  # the logits before the cap


@pytest.mark.parametrize("case", ALL_CASES)
def test_pieces_add_up_to_the_logit(case):
    model = tiny(case)
    whole = model_reason(model)
    if whole is not None:
        with pytest.raises(attnlens.Unavailable, match="attribution"):
            attribution(model, PROMPT, target="a")
        assert all(unavailable(model, layer)["attribution"] == whole for layer in range(model.num_layers))
        return
    found = attribution(model, PROMPT, rows=ROWS, target="a", versus="b")
    a, b = (model.tokenizer(t, add_special_tokens=False).input_ids[0] for t in "ab")
    logits = run_logits(model)
    expected = logits[found.rows, a] - logits[found.rows, b]
    assert close(found.value, expected)
    assert close(found.total, expected)
    split = [layer for layer in range(model.num_layers) if split_reason(model, layer) is None]
    assert sorted(found.heads) == split
    assert sorted(found.unsplit) == [layer for layer in range(model.num_layers) if layer not in split]
    for layer in split:
        assert "attribution" not in unavailable(model, layer)
        heads = model.layers[layer].self_attn.num_heads
        assert found.heads[layer].shape == (len(ROWS), heads, len(found.tokens))
        assert close(found.split_total(layer), found.attention[layer]), layer
    for layer in found.unsplit:
        assert "not split" in unavailable(model, layer)["attribution"]


def test_a_source_after_the_row_gives_nothing():
    model = tiny("llama")
    found = attribution(model, PROMPT, rows=[4], target="a")
    for pieces in found.heads.values():
        assert bool((pieces[0, :, 5:] == 0).all()) and bool((pieces[0, :, :5] != 0).any())


def test_a_direction_and_a_single_token():
    model = tiny("gpt2")  # LayerNorm with a bias: the bias term is not zero
    with torch.no_grad(), model.trace(PROMPT):
        final = model.final_norm_output.save()
    direction = torch.randn(64, generator=torch.Generator().manual_seed(0))
    found = attribution(model, PROMPT, rows=[-1, 0], direction=direction)
    assert close(found.value, final[0, [-1, 0]] @ direction)
    assert close(found.total, found.value)
    assert float(found.final_bias.abs().max()) > 0
    single = attribution(model, PROMPT, target=5)
    assert close(single.total, run_logits(model)[-1:, 5])


def test_miswired_heads_break_the_identity():
    """The identity can fail: the same pieces with a head's values swapped no longer add up."""
    model = tiny("llama")
    found = attribution(model, PROMPT, target="a", versus="b")
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[1].self_attn.attention_head_outputs[:, :, 0] = 0
        logits = model.logits.save()
    a, b = (model.tokenizer(t, add_special_tokens=False).input_ids[0] for t in "ab")
    ablated = logits[0, -1, a] - logits[0, -1, b]
    assert not close(found.total, ablated[None])


def test_bad_input():
    model = tiny("llama")
    with pytest.raises(ValueError, match="not both"):
        attribution(model, PROMPT, target="a", direction=torch.zeros(64))
    with pytest.raises(ValueError, match="2 tokens"):
        attribution(model, PROMPT, target="ab")
    with pytest.raises(IndexError, match="out of range"):
        attribution(model, PROMPT, rows=40, target="a")
    with pytest.raises(ValueError, match=r"direction must be \[64\]"):
        attribution(model, PROMPT, direction=torch.zeros(3))
    sdpa = tiny("llama", attn_implementation="sdpa")
    assert "attention_probabilities is unavailable" in unavailable(sdpa, 0)["attribution"]
    with pytest.raises(attnlens.Unavailable, match="not split by head"):
        attribution(sdpa, PROMPT, target="a", layers=[0])


def test_results_read(tmp_path):
    model = tiny("llama")
    found = attribution(model, PROMPT, target="a", versus="b")
    text = str(found)
    assert "logit('a')" in text and "logit('b')" in text and "frozen" in text
    rows = found.to_rows()
    assert len(rows) == 3 * 4 * len(found.tokens)
    assert {"layer", "head", "source", "token", "contribution"} <= set(rows[0])
    assert abs(sum(term["value"] for term in found.terms()) - float(found.value[0])) < 1e-4
    assert found.plot(tmp_path / "grid.png").stat().st_size > 0
    assert found.plot(tmp_path / "layer.png", layer=1).stat().st_size > 0


def test_every_decode_step_adds_up():
    model = tiny("qwen3")
    steps = attribution(model, PROMPT, target="a", versus="b", max_new_tokens=3)
    a, b = (model.tokenizer(t, add_special_tokens=False).input_ids[0] for t in "ab")
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
        logits = list().save()
        for _ in tracer.iter[:3]:
            logits.append(model.logits[0, -1])
    assert len(steps) == 3
    for step, (found, last) in enumerate(zip(steps, logits)):
        assert found.rows == [len(PROMPT) - 1 + step]
        assert close(found.total, (last[a] - last[b])[None])
        for layer in found.heads:
            assert found.heads[layer].shape == (1, 4, len(PROMPT) + step)
            assert close(found.split_total(layer), found.attention[layer])
