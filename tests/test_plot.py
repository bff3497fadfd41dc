"""attnlens.plot: a labelled PNG of one layer's heads, read back and checked."""

import pytest
import torch
from conftest import PROMPT, tiny

import attnlens
from attnlens.plot import figure, plot

#: the same on every transformers: run on the newest one only (`make test-eager-vllm` deselects it)
pytestmark = pytest.mark.any_transformers

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")


def read_png(path):
    image = Image.open(path)
    assert image.format == "PNG"
    return image


def spread(image) -> float:
    from PIL import ImageStat

    return max(ImageStat.Stat(image.convert("L")).stddev)


def test_a_model_layer_written_and_read_back(tmp_path):
    model = tiny("llama")
    path = plot(model, PROMPT, 1, out=tmp_path / "layer1.png")
    image = read_png(path)
    assert image.size[0] > 600 and image.size[1] > 600 and spread(image) > 20  # 2 x 2 heads, not blank
    # the drawn pattern is the captured one: the darkest head panel's pixels follow the weights (checked on the figure)
    fig = figure(model, PROMPT, 1)
    axes = [ax for ax in fig.axes if ax.get_title().startswith("head ")]
    assert [ax.get_title() for ax in axes] == ["head 0", "head 1", "head 2", "head 3"]
    probs = attnlens.capture_attention(model, PROMPT, 1, keep="probs")[1]["probs"]
    for head, ax in enumerate(axes):
        assert torch.allclose(torch.as_tensor(ax.images[0].get_array()), probs[head])
    assert [t.get_text() for t in axes[2].get_xticklabels()] == [c.replace(" ", "\u2423") for c in PROMPT]
    assert [t.get_text() for t in axes[0].get_yticklabels()] == [c.replace(" ", "\u2423") for c in PROMPT]
    assert fig._suptitle.get_text().startswith("a Llama model · layer 1\n" + PROMPT)
    assert any(ax.get_label() == "<colorbar>" for ax in fig.axes)


def test_one_head_a_capture_and_a_tensor(tmp_path):
    model = tiny("llama")
    one = read_png(plot(model, PROMPT, 2, heads=[3], out=tmp_path / "one.png"))
    grid = read_png(plot(model, PROMPT, 2, out=tmp_path / "grid.png"))
    assert one.size[0] < grid.size[0] and spread(one) > 20
    captured = attnlens.capture_attention(model, PROMPT, [1, 2], keep="probs")
    assert figure(captured, PROMPT, 2, model=model).axes[0].get_title() == "head 0"
    decode = torch.softmax(torch.randn(2, 1, 60), -1)  # one query row, 60 keys: ticks are thinned
    fig = figure(decode, layer=0, tokens=[f"w{i}" for i in range(60)])
    labels = [t.get_text() for t in fig.axes[1].get_xticklabels()]
    assert 10 < len(labels) < 60 and labels[0] == "0 w0"
    read_png(plot(decode, layer=0, out=tmp_path / "decode.png"))


def test_errors(tmp_path):
    model = tiny("llama")
    captured = attnlens.capture_attention(model, PROMPT, [1, 2], keep="probs")
    with pytest.raises(ValueError, match=r"writes \.png"):
        plot(model, PROMPT, 1, out=tmp_path / "x.jpg")
    with pytest.raises(ValueError, match=r"layers \[1, 2\]: pick one with layer="):
        plot(captured, PROMPT, model=model, out=tmp_path / "x.png")
    with pytest.raises(FileNotFoundError):
        plot(model, PROMPT, 1, out=tmp_path / "missing" / "x.png")
