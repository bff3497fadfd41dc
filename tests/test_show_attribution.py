"""The viewer with a direct attribution map beside the pattern: what the page carries decodes back to the
`Attribution`'s own numbers, the per-head totals are `by_head()`'s, the map in a real browser, and the refusals."""

import base64
import json
import re

import cli_run
import pytest
import torch
from conftest import PROMPT, tiny
from test_show import browser, hover_cell, open_page  # noqa: F401 (browser: the fixture, one Chromium per module)

import attnlens
from attnlens.show import show

pytestmark = [pytest.mark.any_transformers, pytest.mark.xdist_group("browser")]

#: One byte per contribution on a signed square-root scale of the layer's largest magnitude `scale`: 128 + sign *
#: round(127 * sqrt(|x| / scale)). A contribution is known to half a step of that root; 128 is exactly zero; 128 +- 1
#: holds every magnitude below SMALLEST * scale (decoded as its middle), with its sign.
HALF_STEP, SMALLEST = 0.5 / 127, (1.5 / 127) ** 2


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture(scope="module")
def found(model):
    return attnlens.attribution(model, PROMPT, rows=[-1, 5], target="a", versus="b")


def page_data(html: str) -> dict:
    """The JSON the page carries, each layer's map decoded back to [heads, rows, keys] contributions."""
    data = json.loads(re.search(r'<script type="application/json" id="[^"]+">(.*?)</script>', html, re.S).group(1))
    rows = len(data["attribution"]["rows"])
    for layer in data["layers"]:
        found = layer["attribution"]
        heads = []
        for text in found["data"]:
            signed = torch.tensor(list(base64.b64decode(text)), dtype=torch.float32) - 128
            assert len(signed) == rows * len(layer["keys"])
            steps = signed.abs()
            magnitude = torch.where(steps == 1, SMALLEST / 2, (steps / 127) ** 2) * found["scale"]
            heads.append((signed.sign() * magnitude).view(rows, len(layer["keys"])))
        found["contributions"] = torch.stack(heads)
    return data


def close(shown, true, scale) -> bool:
    """Whether contributions shown by the page are the true ones, as far as one signed byte each can say."""
    shown, true = torch.as_tensor(shown, dtype=torch.float32), torch.as_tensor(true, dtype=torch.float32)
    root = (shown.abs() / scale).sqrt() - (true.abs() / scale).sqrt()
    near = root.abs() <= HALF_STEP + 1e-6
    small = (shown.abs() == SMALLEST / 2 * scale) & (true.abs() < SMALLEST * scale)
    return bool(((near | small) & (shown.sign() == true.sign())).all())


# --- what the page carries ----------------------------------------------------------------------------------------


def test_the_page_carries_the_attributions_own_numbers(model, found):
    view = show(model, PROMPT, attribution=found)  # with a model and no layers: every layer the attribution splits
    page = page_data(view.html())
    assert [layer["layer"] for layer in page["layers"]] == sorted(found.heads) == [0, 1, 2]
    assert page["attribution"]["rows"] == [17, 5] and page["attribution"]["what"] == found.what
    assert page["attribution"]["values"] == found.value.tolist()
    by_head = found.by_head()
    for layer in page["layers"]:
        number, carried = layer["layer"], layer["attribution"]
        true = found.heads[number].transpose(0, 1)  # [heads, rows, sources]: every source is a key here
        assert carried["scale"] == float(true.abs().max())  # the largest magnitude travels exactly
        assert close(carried["contributions"], true, carried["scale"])
        assert ((carried["contributions"] == 0) == (true == 0)).all()  # row 5 reads no later key: exactly zero
        assert (carried["contributions"][:, 1, 6:] == 0).all()
        # each head's total travels exactly, over every source: by_head(), grid(), and with the attention bias the
        # layer's whole attention update (the per-layer identity, read off the page)
        totals = torch.tensor(carried["totals"])
        assert torch.equal(totals, by_head[number])
        for row in range(2):
            assert torch.allclose(totals[row], found.grid(row)[number], atol=1e-6)
        assert torch.allclose(totals.sum(-1) + found.attention_bias[number], found.attention[number], atol=1e-5)


def test_a_subset_of_heads_and_of_keys_carries_those_heads_and_keys(model, found):
    picked = page_data(show(model, PROMPT, [1], heads=[3, 1], attribution=found).html())["layers"][0]
    assert picked["heads"] == [3, 1]
    true = found.heads[1][:, [3, 1]].transpose(0, 1)
    assert close(picked["attribution"]["contributions"], true, picked["attribution"]["scale"])
    assert torch.equal(torch.tensor(picked["attribution"]["totals"]), found.by_head()[1][:, [3, 1]])

    # a pattern of the last 4 keys (a sliding window's): the map has those sources as columns, totals over all
    probs = attnlens.capture_attention(model, PROMPT, 2, keep="probs")[2]["probs"][:, :, -4:]
    window = show(probs, layers=2, tokens=list(PROMPT), key_positions=range(14, 18), attribution=found)
    carried = page_data(window.html())["layers"][0]["attribution"]
    true = found.heads[2][:, :, 14:18].transpose(0, 1)
    assert carried["scale"] == float(true.abs().max()) and close(carried["contributions"], true, carried["scale"])
    assert torch.equal(torch.tensor(carried["totals"]), found.by_head()[2])


def test_a_decode_steps_attribution_beside_its_pattern(model):
    steps = attnlens.attribution(model, PROMPT, target="a", max_new_tokens=2)
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
        patterns = list().save()
        for _ in tracer.iter[:2]:
            patterns.append(model.layers[1].self_attn.attention_probabilities)
        ids = tracer.result.save()
    tokens = [model.tokenizer.decode([i]) for i in ids[0].tolist()][: len(PROMPT) + 1]
    assert steps[1].tokens[-1] == "<generated 0>"  # a label, matched by any token
    view = show(patterns[1], layers=1, tokens=tokens, attribution=steps[1])
    carried = page_data(view.html())["layers"][0]["attribution"]
    assert view.patterns.layers[0].query_positions == steps[1].rows == [len(PROMPT)]
    assert close(carried["contributions"], steps[1].heads[1].transpose(0, 1), carried["scale"])


def test_an_eager_sliding_window_steps_attribution_reads_the_windows_keys():
    """Eager transformers keeps a sliding window's keys only: a decode step's sources are the pattern's keys."""
    model = tiny("mistral")  # a window of 4 keys
    steps = attnlens.attribution(model, PROMPT, target="a", max_new_tokens=2)
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
        patterns = list().save()
        for _ in tracer.iter[:2]:
            patterns.append(model.layers[1].self_attn.attention_probabilities)
    pieces = steps[1].heads[1]
    assert pieces.shape == (1, 4, 4) and len(steps[1].tokens) == len(PROMPT) + 1
    view = show(patterns[1], layers=1, tokens=steps[1].tokens, attribution=steps[1])
    carried = page_data(view.html())["layers"][0]["attribution"]
    assert view.patterns.layers[0].key_positions == list(range(len(PROMPT) - 3, len(PROMPT) + 1))
    assert close(carried["contributions"], pieces.transpose(0, 1), carried["scale"])
    with pytest.raises(ValueError, match="reads 4 sources, the pattern 3 keys of 19 tokens"):
        show(patterns[1][..., 1:], layers=1, tokens=steps[1].tokens, attribution=steps[1])


def test_attribution_show_is_show_with_it(model, found):
    view = found.show(model, PROMPT, layers=1)
    assert view.attribution is found and [p.layer for p in view.patterns.layers] == [1]
    assert page_data(view.html())["layers"][0]["attribution"]["totals"] == found.by_head()[1].tolist()


def test_errors_name_what_was_wrong(model, found):
    other = attnlens.attribution(model, "Jello world, again", target="a")
    with pytest.raises(ValueError, match="another prompt: token 0 is 'H' here and 'J' in the attribution"):
        show(model, PROMPT, 1, attribution=other)
    short = attnlens.attribution(model, "Hi", target="a")
    with pytest.raises(ValueError, match="the attribution is of 2 tokens but the pattern of 18: attribute the prompt"):
        show(model, PROMPT, 1, attribution=short)
    some = attnlens.attribution(model, PROMPT, target="a", layers=[1])
    with pytest.raises(ValueError, match=r"layer 2 is not split by head in this attribution \(not asked for\)"):
        show(model, PROMPT, [1, 2], attribution=some)
    with pytest.raises(ValueError, match="attribute with layers= including it"):
        show(model, PROMPT, [1, 2], attribution=some)
    assert [p.layer for p in show(model, PROMPT, attribution=some).patterns.layers] == [1]
    qwen = attnlens.attribution(tiny("qwen3"), PROMPT, target="a")
    with pytest.raises(ValueError, match="the attribution is of a Qwen3 model, the pattern of a Llama model"):
        show(model, PROMPT, 1, attribution=qwen)
    probs = attnlens.capture_attention(model, PROMPT, 1, keep="probs")[1]["probs"]
    with pytest.raises(ValueError, match="token 0 is '0' here"):  # a tensor without its tokens
        show(probs, layers=1, attribution=found)
    with pytest.raises(ValueError, match="needs its layer: label it with layers="):
        show(probs, tokens=list(PROMPT), attribution=found)
    with pytest.raises(TypeError, match=r"what attnlens\.attribution returns; got dict"):
        show(model, PROMPT, 1, attribution={"heads": {}})


def test_the_command_line_writes_the_page(tmp_path):
    out = tmp_path / "map.html"
    run = cli_run.attnlens("attribute", "tiny:llama", PROMPT, "--target", "a", "--layer", "1", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == str(out)
    page = page_data(out.read_text())
    assert [layer["layer"] for layer in page["layers"]] == [1] and page["attribution"]["what"] == "logit('a')"


# --- in a browser -----------------------------------------------------------------------------------------------------


def test_the_map_in_a_browser(browser, tmp_path, model, found):  # noqa: F811 (the fixture imported above)
    path = show(model, PROMPT, [1, 2], attribution=found).save(tmp_path / "page.html")
    view = open_page(browser, path)
    scale = {layer: float(found.heads[layer].abs().max()) for layer in found.heads}
    fields = ("head", "query", "key", "contribution")
    assert view.find_element("css selector", "canvas.al-map").is_displayed()
    assert view.get_attribute("data-row") == "17" and found.what in view.text

    def hover(row, column):
        return hover_cell(browser, view, row, column, canvas="al-map", cell="mapCell", fields=fields)

    # every source of head 0's attributed row 17: the tooltip names the source token and gives its contribution
    for source in (0, 4, 17):
        text, data = hover(0, source)
        assert (data["head"], data["query"], data["key"]) == ("0", "17", str(source))
        assert f"source {source} {json.dumps(PROMPT[source])}" in text and 'query  17 "n"' in text
        assert close(float(data["contribution"]), found.heads[1][0, 0, source], scale[1])
    text, data = hover(1, 3)  # the second attributed row, 5
    assert data["query"] == "5" and close(float(data["contribution"]), found.heads[1][1, 0, 3], scale[1])
    assert float(hover(1, 9)[1]["contribution"]) == 0  # row 5 reads no later key

    def captions():
        return [float(c.get_attribute("data-total")) for c in view.find_elements("css selector", "figcaption")]

    assert captions() == found.by_head()[1][0].tolist()
    view.find_elements("css selector", "canvas.al-thumb")[2].click()  # head 2, large: its own map
    largest = int(found.heads[1][0, 2].abs().argmax())
    text, data = hover(0, largest)
    assert data["head"] == "2" and close(float(data["contribution"]), found.heads[1][0, 2, largest], scale[1])
    written = float(re.search(r"contribution ([-+][\d.e+-]+)", text).group(1))  # to 3 significant digits
    assert written == pytest.approx(float(data["contribution"]), rel=5e-3)

    from selenium.webdriver.support.ui import Select

    Select(view.find_element("css selector", "select.al-row")).select_by_index(1)  # totals of row 5
    assert view.get_attribute("data-row") == "5" and captions() == found.by_head()[1][1].tolist()
    Select(view.find_element("css selector", "select.al-layer")).select_by_visible_text("2")
    assert captions() == found.by_head()[2][1].tolist()
    text, data = hover(0, 2)
    assert "layer 2" in text and close(float(data["contribution"]), found.heads[2][0, 0, 2], scale[2])

    # the colour's side is the sign's: the head's most positive source is red, its most negative blue
    pieces = found.heads[2][0, 0]
    red, blue = browser.execute_script(  # one readback of the whole canvas (Chromium warns at a second)
        "const [c, id, sources] = arguments, image = c.getContext('2d').getImageData(0, 0, c.width, c.height);"
        "return sources.map((s) => { const [x, y] = window.attnlens[id].mapCell(0, s).map(Math.floor);"
        "  return Array.from(image.data.slice(4 * (y * c.width + x), 4 * (y * c.width + x) + 4)); });",
        view.find_element("css selector", "canvas.al-map"),
        view.get_attribute("id"),
        [int(pieces.argmax()), int(pieces.argmin())],
    )
    assert pieces.max() > 0 > pieces.min() and red[0] > red[2] and blue[2] > blue[0]


def test_a_page_without_attribution_hides_the_map(browser, tmp_path, model):  # noqa: F811
    view = open_page(browser, show(model, PROMPT, 1).save(tmp_path / "plain.html"))
    assert not view.find_element("css selector", "canvas.al-map").is_displayed()
    assert not view.find_element("css selector", "select.al-row").is_displayed()
    assert view.get_attribute("data-row") is None
