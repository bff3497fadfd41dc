"""Head summaries of prompts with images (`head_summaries(model, inputs)`, inputs the model's: input_ids,
pixel_values and the rest), against the same metrics computed by hand from the eager `attention_probabilities`.

The tiny Gemma 3 (image token 129 between 130 and 131, 2 x 2 tokens per 32 x 32 image, an image's tokens seeing each
other both ways) and the tiny LLaVA (16 tokens of image 129 per 32 x 32 image, causal as text). Every metric on a
prompt with two images: the entropy and the sink over every row (image rows included, where Gemma 3's mask lets them
see their image's later tokens), `image` over the text rows after the first image token, and the repeated-token
scores, within 1e-5 (float32 sums of a few dozen terms against float64 by hand).
"""

from __future__ import annotations

import pytest
import torch

import attnlens
from attnlens.errors import Unavailable
from attnlens.heads import repeated_tokens

IMAGE, START, END = 129, 130, 131
GEMMA = torch.tensor([[1, 40, 41, START, *[IMAGE] * 4, END, 42, START, *[IMAGE] * 4, END, 43, 44]])
LLAVA = torch.tensor([[1, 40, *[IMAGE] * 16, 42, *[IMAGE] * 16, 43]])
#: Per model: the prompt, its text rows after the first image token, its image tokens (written out, not read from
#: `model.positions`).
CASES = {
    "gemma3": (GEMMA, [9, 16, 17], [4, 5, 6, 7, 11, 12, 13, 14]),
    "llava": (LLAVA, [18, 35], [*range(2, 18), *range(19, 35)]),
}
LENGTH, SEQUENCES = 6, 2  # the repeated sequences: BOS + R + R, R of 6 tokens, two of them
ATOL = 1e-5


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    name = request.param
    prompt, rows, keys = CASES[name]
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": prompt, "pixel_values": pixels}
    if name == "gemma3":
        inputs["token_type_ids"] = (prompt == IMAGE).long()
    return attnlens.models.tiny(name), inputs, rows, keys


def _patterns(model, ids, **inputs) -> list[torch.Tensor]:
    """Every layer's eager pattern, float64: [batch, heads, query, key]."""
    found = []
    with torch.no_grad(), model.trace(ids, **inputs):
        for i in range(model.num_layers):
            found.append(model.layers[i].self_attn.attention_probabilities.save())
    return [pattern.double() for pattern in found]


def _by_hand(model, prompts: list[tuple[dict, list[int], list[int]]]) -> dict[str, list[torch.Tensor]]:
    """Per metric, per layer, [heads]: the means over the rows each metric counts, over every prompt."""
    sums = {name: [0.0] * model.num_layers for name in ("entropy", "sink", "image")}
    counts = {"entropy": 0, "image": 0}
    for inputs, rows, keys in prompts:
        rest = {name: value for name, value in inputs.items() if name != "input_ids"}
        for layer, pattern in enumerate(_patterns(model, inputs["input_ids"], **rest)):
            pattern = pattern[0]  # [heads, query, key]
            sums["entropy"][layer] += -torch.special.xlogy(pattern, pattern).sum(-1).sum(-1)
            sums["sink"][layer] += pattern[..., 0].sum(-1)
            sums["image"][layer] += pattern[:, rows][..., keys].sum(-1).sum(-1)
        counts["entropy"] += inputs["input_ids"].shape[1]
        counts["image"] += len(rows)
    found = {
        "entropy": [s / counts["entropy"] for s in sums["entropy"]],
        "sink": [s / counts["entropy"] for s in sums["sink"]],
        "image": [s / counts["image"] for s in sums["image"]],
    }
    sequences = repeated_tokens(model, LENGTH, SEQUENCES)
    total = sequences.shape[1]
    second = list(range(total - LENGTH, total))  # the second copy's rows
    for name, (rows, back) in {
        "previous": (list(range(1, total)), 1),
        "duplicate": (second, LENGTH),
        "induction": (second, LENGTH - 1),
    }.items():
        found[name] = [
            pattern[:, :, rows, [row - back for row in rows]].mean(dim=(0, 2))
            for pattern in _patterns(model, sequences)
        ]
    return found


def _summaries(model, prompts, **options):
    return attnlens.head_summaries(model, prompts, length=LENGTH, sequences=SEQUENCES, progress=False, **options)


@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_every_metric_on_a_prompt_with_two_images_equals_the_eager_pattern_by_hand(case, chunk_rows):
    """Entropy and sink over every row (image rows included), `image` over the text rows after an image, and the
    repeated-token scores equal the eager pattern's within 1e-5; with 3 rows a chunk, a chunk boundary falls inside
    an image (Gemma 3's rows 3-5: its rows still see the image's later tokens)."""
    model, inputs, rows, keys = case
    found = _summaries(model, inputs, chunk_rows=chunk_rows)
    assert found.metrics == ["entropy", "sink", "previous", "duplicate", "induction", "image"]
    expected = _by_hand(model, [(inputs, rows, keys)])
    for metric in found.metrics:
        for layer in range(model.num_layers):
            assert torch.allclose(found.get(metric, layer).double(), expected[metric][layer], atol=ATOL), (
                metric,
                layer,
            )
    assert all(0 < float(v) < 1 for layer in found.layers for v in found.get("image", layer))
    assert "text row after an image" in found.to_json()  # the metric's description goes with the numbers


def test_the_metrics_average_over_every_prompts_rows(case):
    """Two prompts (the two-image prompt, and its text before the second image: one image): the entropy and sink
    average over both prompts' rows, `image` over both prompts' counted rows."""
    model, inputs, rows, keys = case
    cut = 10 if model.family.name.startswith("Gemma") else 19  # one image and a text token after it
    one = {**inputs, "input_ids": inputs["input_ids"][:, :cut], "pixel_values": inputs["pixel_values"][:1]}
    if "token_type_ids" in inputs:
        one["token_type_ids"] = inputs["token_type_ids"][:, :cut]
    found = _summaries(model, [inputs, one])
    expected = _by_hand(model, [(inputs, rows, keys), (one, [cut - 1], [k for k in keys if k < cut])])
    for metric in ("entropy", "sink", "image"):
        for layer in range(model.num_layers):
            assert torch.allclose(found.get(metric, layer).double(), expected[metric][layer], atol=ATOL), (
                metric,
                layer,
            )


def test_the_image_metric_is_absent_on_text_prompts(case):
    """A text prompt (and a tokenizer's encoding, no pixel_values) has no `image` metric, and `get` says why; the
    other metrics are those of a plain prompt."""
    model = case[0]
    text = torch.tensor([[1, 40, 41]])
    plain = _summaries(model, [text[0]])
    assert "image" not in plain.metrics
    with pytest.raises(KeyError, match="prompts with images only"):
        plain.get("image", 0)
    encoding = {"input_ids": text, "attention_mask": torch.ones_like(text), "token_type_ids": torch.zeros_like(text)}
    as_inputs = _summaries(model, encoding)  # a tokenizer's encoding: plain prompts, as before
    assert as_inputs.metrics == plain.metrics
    for metric in plain.metrics:
        assert torch.allclose(as_inputs.get(metric, 0), plain.get(metric, 0), atol=ATOL)


def test_gemma3_on_sdpa_summarises_as_eager():
    """Head summaries read only the queries and keys: on sdpa, the image prompt's metrics equal eager's."""
    prompt = CASES["gemma3"][0]
    inputs = {
        "input_ids": prompt,
        "pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
        "token_type_ids": (prompt == IMAGE).long(),
    }
    eager = _summaries(attnlens.models.tiny("gemma3"), inputs)
    sdpa = _summaries(attnlens.models.tiny("gemma3", attn_implementation="sdpa"), inputs)
    for metric in eager.metrics:
        for layer in eager.layers:
            assert torch.allclose(sdpa.get(metric, layer), eager.get(metric, layer), atol=ATOL), (metric, layer)


def test_refusals(case, monkeypatch):
    """Several prompts in one dict are refused (one dict per prompt), and an engine other than transformers is
    refused by name, before anything runs."""
    model, inputs, _, _ = case
    doubled = {**inputs, "input_ids": inputs["input_ids"].repeat(2, 1)}
    with pytest.raises(ValueError, match="a list of dicts, one per prompt"):
        _summaries(model, doubled)
    monkeypatch.setattr(model.access, "engine", "vllm")
    with pytest.raises(Unavailable, match="transformers engine"):
        _summaries(model, inputs)
