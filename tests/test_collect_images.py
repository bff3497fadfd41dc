"""`attnlens.collect` over prompts with images: a corpus row names its image files (`image_field`), the model's
processor builds the inputs, `model.positions` places the image tokens, and the `image_share` feature (the text rows'
attention on the images, in all and per image) goes to the same Parquet, beside the other features, with resume intact.

On the tiny Gemma 3 (`models.tiny("gemma3")`, its processor from `models.tiny_processor`): each image is 4 image
tokens (2 x 2) between its start and end tokens, which see each other both ways.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny
from PIL import Image
from test_collect import by_prompt, write_jsonl

import attnlens
from attnlens.collect import read_table, store
from attnlens.models import processor_inputs, tiny_processor

#: the same on every transformers: run on the newest one only (as tests/test_collect.py)
pytestmark = pytest.mark.any_transformers

TOLERANCE = dict(atol=2e-5, rtol=1e-5)


def _picture(path, seed: int, size=(24, 40)):
    pixels = torch.rand(*size, 3, generator=torch.Generator().manual_seed(seed)) * 255
    Image.fromarray(pixels.byte().numpy()).save(path)
    return path


@pytest.fixture
def shown(tmp_path):
    """A corpus of prompts with one image, two images (placeholders in the text), none, and a missing file."""
    _picture(tmp_path / "cat.png", 0)
    _picture(tmp_path / "dog.png", 1, (40, 24))
    rows = [
        {"id": "one", "text": "Describe this picture.", "image": "cat.png"},
        {"id": "text", "text": "No picture at all"},
        {"id": "two", "text": "Compare <start_of_image> with <start_of_image> now.", "image": ["cat.png", "dog.png"]},
        {"id": "missing", "text": "Where is it?", "image": "nowhere.png"},
    ]
    return write_jsonl(tmp_path / "corpus.jsonl", rows), rows


def _by_hand(model, rows, folder):
    """Per prompt with images: each layer's pattern from the eager engine (its own values, read on the processor's
    inputs) and the prompt's positions."""
    processor = tiny_processor("gemma3")
    found = {}
    for index, row in enumerate(rows):
        files = row.get("image")
        if files is None or files == "nowhere.png":
            continue
        files = [files] if isinstance(files, str) else files
        images = [Image.open(folder / name).convert("RGB") for name in files]
        inputs = processor_inputs(processor, row["text"], images)
        patterns = []
        with torch.no_grad(), model.trace(inputs["input_ids"], **{k: v for k, v in inputs.items() if k != "input_ids"}):
            for layer in range(model.num_layers):
                patterns.append(model.layers[layer].self_attn.attention_probabilities.save())
        found[index] = (patterns, model.positions(inputs), inputs["input_ids"].shape[1])
    return found


def test_the_image_share_equals_a_hand_computation_from_the_saved_pattern(shown, tmp_path):
    """For each head: the mean over the text rows after the first image token of the pattern's weight on every image
    token, and on each image's; the other features of a prompt with images are the eager pattern's (its image rows
    see their image both ways); a text prompt has nan and no per-image share; a missing file is an error."""
    path, rows = shown
    model = tiny("gemma3")
    result = attnlens.collect(
        model, path, ["entropy", "sink", "image_share"], tmp_path / "out", image_field="image",
        processor=tiny_processor("gemma3"), shard_size=2, progress=False,
    )  # fmt: skip
    assert result.errors == 1 and result.prompts == 4
    failed = read_table(tmp_path / "out", "errors").to_pylist()
    assert failed[0]["prompt"] == 3 and failed[0]["reason"] == "undecodable" and "nowhere.png" in failed[0]["detail"]
    table = by_prompt(read_table(tmp_path / "out"))
    heads = model.access.geometry(0).num_heads
    for index, (patterns, positions, tokens) in _by_hand(model, rows, tmp_path).items():
        kind, image = positions.kind[0], positions.image[0]
        first = int((image >= 0).nonzero()[0])
        text_rows = (kind == 0) & (torch.arange(tokens) > first)
        assert int(text_rows.sum()) >= 3
        for layer, pattern in enumerate(patterns):
            p = pattern[0]
            on_images = p[:, text_rows][..., image >= 0].sum(-1).mean(-1)
            each = [p[:, text_rows][..., image == i].sum(-1).mean(-1) for i in range(len(positions.grids[0]))]
            entropy = torch.special.entr(p).sum(-1).mean(-1)
            for h in range(heads):
                row = table[index, layer, h]
                assert row["tokens"] == tokens
                assert row["image_share"] == pytest.approx(float(on_images[h]), abs=2e-5)
                assert row["image_shares"] == pytest.approx([float(e[h]) for e in each], abs=2e-5)
                assert row["entropy"] == pytest.approx(float(entropy[h]), abs=2e-5)
                assert row["sink"] == pytest.approx(float(p[h, :, 0].mean()), abs=2e-5)
        assert len(table[index, 0, 0]["image_shares"]) == len(positions.grids[0])
    text = table[1, 0, 0]
    assert text["image_share"] != text["image_share"] and text["image_shares"] == []


def test_the_image_rows_are_scored_both_ways(shown, tmp_path, monkeypatch):
    """Can fail: with the score function not told where the images sit (image tokens held to the causal mask), the
    entropy of a prompt with images is not the eager pattern's."""
    from attnlens.collect import features

    path, rows = shown
    model = tiny("gemma3")
    monkeypatch.setattr(features.Context, "scores", lambda self: attnlens.heads.score_function(self.attn))
    attnlens.collect(
        model, path, ["entropy"], tmp_path / "out", image_field="image", processor=tiny_processor("gemma3"),
        progress=False,
    )  # fmt: skip
    table = by_prompt(read_table(tmp_path / "out"))
    patterns, _, _ = _by_hand(model, rows, tmp_path)[0]
    entropy = torch.special.entr(patterns[1][0]).sum(-1).mean(-1)
    assert table[0, 1, 0]["entropy"] != pytest.approx(float(entropy[0]), abs=2e-5)


@pytest.mark.parametrize(
    "crash_at", [2, 3]
)  # renames: 0 collect.json, 1 window 0's data, 2 and 3 window 1's errors, data
def test_a_crash_mid_run_resumes_with_every_prompt_with_images_exactly_once(crash_at, tmp_path, monkeypatch):
    """Killed before a window's shard is renamed into place, the same call again repeats only that window: every
    prompt (with images, without, and the one that fails) is written once."""
    _picture(tmp_path / "cat.png", 0)
    items = []
    for i in range(7):
        item = {"text": f"Prompt {i} about it."}
        if i % 2 == 0:
            item["image"] = "cat.png"
        items.append(item)
    items[5]["image"] = "gone.png"  # one error
    path = write_jsonl(tmp_path / "c.jsonl", items)
    out, model, processor = tmp_path / "out", tiny("gemma3"), tiny_processor("gemma3")
    replace, calls = store.os.replace, {"n": 0}

    def crashing(src, dst):
        calls["n"] += 1
        if calls["n"] - 1 == crash_at:
            raise KeyboardInterrupt("killed before the rename")
        replace(src, dst)

    monkeypatch.setattr(store.os, "replace", crashing)
    arguments = dict(image_field="image", processor=processor, shard_size=3, progress=False)
    with pytest.raises(KeyboardInterrupt):
        attnlens.collect(model, path, ["sink", "image_share"], out, **arguments)
    monkeypatch.setattr(store.os, "replace", replace)
    result = attnlens.collect(model, path, ["sink", "image_share"], out, **arguments)
    assert result.already_done + result.prompts == 7 and result.already_done > 0
    assert not list(out.rglob(".*.tmp"))
    data = read_table(out).to_pylist()
    keys = [(r["prompt"], r["layer"], r["head"]) for r in data]
    assert len(keys) == len(set(keys))
    assert sorted(r["prompt"] for r in read_table(out, "errors").to_pylist()) == [5]
    assert sorted({r["prompt"] for r in data}) == [0, 1, 2, 3, 4, 6]
    with_images = {r["prompt"] for r in data if r["image_shares"]}
    assert with_images == {0, 2, 4, 6}


def test_images_are_refused_where_they_cannot_run(shown, tmp_path):
    """No processor to be had, Ray workers, a text file: each refused before anything runs, saying what to do."""
    path, _ = shown
    model = tiny("gemma3")
    with pytest.raises(ValueError, match="pass processor="):
        attnlens.collect(model, path, ["sink"], tmp_path / "a", image_field="image", progress=False)
    with pytest.raises(ValueError, match="collect with images runs in this process"):
        attnlens.collect("folder", path, ["sink"], tmp_path / "b", image_field="image", workers=2, progress=False)
    text = tmp_path / "c.txt"
    text.write_text("one\n")
    with pytest.raises(ValueError, match="a text file holds no image field"):
        attnlens.collect(model, text, ["sink"], tmp_path / "c", image_field="image", progress=False)
    bad = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"text": "x", "image": 3})])
    attnlens.collect(model, bad, ["sink"], tmp_path / "d", image_field="image", processor=tiny_processor("gemma3"))
    assert "not an image path" in read_table(tmp_path / "d", "errors").to_pylist()[0]["detail"]


def test_the_command_line_takes_an_image_field(shown, tmp_path, capsys):
    """`attnlens collect tiny:gemma3 CORPUS --image-field image`: the tiny model's processor, the same table."""
    from attnlens.cli import main

    path, _ = shown
    out = tmp_path / "cli"
    assert main(["collect", "tiny:gemma3", str(path), "--out", str(out), "--features", "image_share",
                 "--image-field", "image"]) == 0  # fmt: skip
    assert "4 this run" in capsys.readouterr().out
    table = by_prompt(read_table(out))
    assert len(table[2, 0, 0]["image_shares"]) == 2 and read_table(out, "errors")["prompt"].to_pylist() == [3]


def test_a_chosen_row_on_an_image_token_is_refused_where_the_image_sees_itself_both_ways(shown, tmp_path):
    """Gemma 3's image tokens see their image's later tokens: a chosen row there is not read up to its own position
    (pattern, span_mass, lookback), and the prompt goes to the errors table saying so; text rows are served."""
    path, _ = shown
    model, processor = tiny("gemma3"), tiny_processor("gemma3")
    inputs = processor_inputs(processor, "Describe this picture.", [Image.new("RGB", (8, 8))])
    image = int((model.positions(inputs).image[0] >= 0).nonzero()[0])  # prompt 0's first image token
    arguments = dict(image_field="image", processor=processor, progress=False)
    attnlens.collect(model, path, ["pattern"], tmp_path / "out", rows=[image], **arguments)
    failed = {r["prompt"]: r for r in read_table(tmp_path / "out", "errors").to_pylist()}
    assert "are image tokens" in failed[0]["detail"] and 1 not in failed  # the text prompt's row is text
    attnlens.collect(model, path, ["pattern"], tmp_path / "text", rows=[-1], **arguments)
    assert read_table(tmp_path / "text", "errors")["prompt"].to_pylist() == [3]
