"""The HTML viewer: what it is given, what the page holds, and the page in a real headless browser (Chromium)."""

import base64
import json
import os
import re
import time

import pytest
import torch
from conftest import PROMPT, tiny

import attnlens
from attnlens.models import char_tokenizer, tiny_model
from attnlens.show import patterns, show

#: the same on every transformers: run on the newest one only (`make test-eager-vllm` deselects it); on one
#: worker under pytest-xdist (`--dist loadgroup`), so its browser starts once
pytestmark = [pytest.mark.any_transformers, pytest.mark.xdist_group("browser")]

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
#: One byte per weight on a square-root scale: a weight is known to half a step of its square root; byte 0 is exactly
#: zero, byte 1 any weight below SMALLEST (shown as its middle).
HALF_STEP, SMALLEST = 0.5 / 255, (1.5 / 255) ** 2


def page_data(html: str) -> dict:
    """The JSON the page carries, decoded back to one [heads, query, key] tensor of weights per layer."""
    data = json.loads(re.search(r'<script type="application/json" id="[^"]+">(.*?)</script>', html, re.S).group(1))
    for layer in data["layers"]:
        lengths = layer["lengths"]
        weights = torch.zeros(len(layer["heads"]), len(layer["queries"]), len(layer["keys"]))
        for h, text in enumerate(layer["data"]):
            raw = torch.tensor(list(base64.b64decode(text)), dtype=torch.float32)
            assert len(raw) == sum(lengths)
            at = 0
            for r, n in enumerate(lengths):
                part = raw[at : at + n]
                weights[h, r, :n] = torch.where(part == 1, SMALLEST / 2, (part / 255) ** 2)
                at += n
        layer["weights"] = weights
    return data


def close(shown, true) -> bool:
    """Whether weights shown by the page are the true ones, as far as one byte each can say."""
    shown, true = torch.as_tensor(shown, dtype=torch.float32), torch.as_tensor(true, dtype=torch.float32)
    near = (shown.sqrt() - true.sqrt()).abs() <= HALF_STEP + 1e-6
    tiny = (shown == SMALLEST / 2) & (true > 0) & (true < SMALLEST)
    return bool(((near | tiny) & ((shown == 0) == (true == 0))).all())


# --- what show() takes ----------------------------------------------------------------------------------------------


def test_a_model_and_prompt_a_capture_and_a_tensor_give_the_same_page_data():
    model = tiny("llama")
    captured = attnlens.capture_attention(model, PROMPT, [1, 2], keep="probs")
    from_model = patterns(model, PROMPT, [1, 2])
    from_capture = patterns(captured, PROMPT, model=model)
    from_tensor = patterns(captured[2]["probs"][None], layers=2, tokens=list(PROMPT))  # a batch axis of one too
    assert [p.layer for p in from_model.layers] == [1, 2] == [p.layer for p in from_capture.layers]
    for a, b in zip(from_model.layers, from_capture.layers):
        assert torch.equal(a.probs, b.probs) and a.heads == [0, 1, 2, 3]
    assert torch.equal(from_tensor.layers[0].probs, captured[2]["probs"])
    assert from_model.tokens == list(PROMPT) == from_tensor.tokens and from_model.prompt == PROMPT
    assert from_model.model == "a Llama model" and from_tensor.model == ""
    assert from_model.layers[0].key_positions == list(range(len(PROMPT))) == from_model.layers[0].query_positions

    page = page_data(show(model, PROMPT, [1, 2]).html())
    assert [layer["layer"] for layer in page["layers"]] == [1, 2] and page["tokens"] == list(PROMPT)
    for layer, pattern in zip(page["layers"], from_model.layers):
        assert close(layer["weights"], pattern.probs)
        # a causal pattern ships its lower triangle: each row up to its last non-zero weight
        assert layer["lengths"] == [r + 1 for r in range(len(PROMPT))]


def test_heads_subsets_and_their_labels():
    model = tiny("llama")
    picked = patterns(model, PROMPT, 1, heads=[3, 1])  # head numbers on a model
    assert picked.layers[0].heads == [3, 1] and picked.layers[0].probs.shape[0] == 2
    kept = attnlens.capture_attention(model, PROMPT, 1, keep="probs", heads=[3, 1])
    assert torch.equal(patterns(kept, PROMPT, model=model, head_labels=[3, 1]).layers[0].probs, picked.layers[0].probs)
    full = attnlens.capture_attention(model, PROMPT, 1, keep="probs")
    one = patterns(full, PROMPT, model=model, heads=[2]).layers[0]  # indexes into the pattern's heads
    assert one.heads == [2] and torch.equal(one.probs, full[1]["probs"][[2]])
    again = patterns(kept, PROMPT, model=model, head_labels=[3, 1], heads=[1]).layers[0]  # a subset of a subset
    assert again.heads == [1] and torch.equal(again.probs, full[1]["probs"][[1]])
    with pytest.raises(ValueError, match="head_labels names 3 heads for a pattern of 2"):
        patterns(kept, PROMPT, model=model, head_labels=[3, 1, 0])


def test_rebuilt_patterns_on_sdpa():
    model = attnlens.StandardizedTransformer(
        tiny_model("qwen3"), tokenizer=char_tokenizer(), attn_implementation="sdpa", rebuild_patterns=True
    )
    rebuilt = patterns(model, PROMPT, [0, 2]).layers
    eager = patterns(tiny("qwen3"), PROMPT, [0, 2]).layers
    for a, b in zip(rebuilt, eager):
        assert torch.allclose(a.probs, b.probs, atol=1e-6)


def test_a_sliding_window_decode_step_labels_its_keys_with_their_positions():
    """Eager transformers keeps only the window in the cache: a decode step's keys are the last W positions."""
    model = tiny("mistral")  # sliding window 4 on every layer
    window = model.config.sliding_window
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0) as tracer:
        steps = list().save()
        for _ in tracer.iter[:3]:
            steps.append(model.layers[1].self_attn.attention_probabilities)
        result = tracer.result.save()
    tokens = [model.tokenizer.decode([int(i)]) for i in result[0]]
    step = steps[2]  # [1, heads, 1, window]
    total = len(PROMPT) + 2  # positions seen by the third step
    assert step.shape[-1] == window
    given = patterns(step, layers=1, tokens=tokens[:total], key_positions=range(total - window, total)).layers[0]
    default = patterns(step, layers=1, tokens=tokens[:total]).layers[0]  # the last keys, by default
    assert given.key_positions == default.key_positions == list(range(total - window, total))
    assert given.query_positions == [total - 1]
    with pytest.raises(ValueError, match="key_positions gives 3 positions for a pattern with 4 keys"):
        patterns(step, layers=1, tokens=tokens[:total], key_positions=[0, 1, 2])
    with pytest.raises(IndexError, match=r"must lie in \[0, 20\)"):
        patterns(step, layers=1, tokens=tokens[:total], key_positions=[17, 18, 19, 20])


def test_errors_name_what_was_wrong(tmp_path):
    model = tiny("llama")
    captured = attnlens.capture_attention(model, [PROMPT, "Hi"], [1], keep="probs")
    with pytest.raises(ValueError, match="a capture of 2 prompts; a picture shows one: pass out"):
        show(captured)
    with pytest.raises(ValueError, match="holds no 'probs'"):
        show(attnlens.capture_attention(model, PROMPT, [1], keep="value"))
    with pytest.raises(IndexError, match=r"layers \[2\] are not in this capture; it holds \[1\]"):
        show(captured[0], layers=[2])
    with pytest.raises(IndexError, match="head 4 is out of range: there are 4"):
        show(model, PROMPT, 1, heads=[4])
    with pytest.raises(IndexError, match=r"layer 5 is out of range.*\[0, 3\)"):
        show(model, PROMPT, 5)
    with pytest.raises(ValueError, match="name the prompt and the layers"):
        show(model, PROMPT)
    with pytest.raises(ValueError, match=r"a pattern is \[heads, query, key\]"):
        show(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="only 3 tokens are known"):
        show(torch.zeros(1, 4, 4), tokens=["a", "b", "c"])
    with pytest.raises(TypeError, match="got str"):
        show("Hello")
    with pytest.raises(attnlens.Unavailable, match="never forms it"):
        show(attnlens.models.tiny("llama", attn_implementation="sdpa"), PROMPT, 1)
    with pytest.raises(ValueError, match=r"\.html"):
        show(torch.rand(1, 3, 3)).save(tmp_path / "page.png")


def test_the_page_is_self_contained_and_escapes_its_text(tmp_path):
    tokens = ["</script>", "<b>&", " x"]
    view = show(torch.tensor([[[1.0, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]]]), tokens=tokens, title="m<i>")
    page = view.save(tmp_path / "page.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "m&lt;i&gt;" in page and "<i>" not in page
    assert '</script>"' not in page and page.count("</script>") == 2  # the JSON's tokens cannot end the script
    assert not re.search(r"(src|href)\s*=|<link|@import|https?:", page)  # nothing fetched
    assert page_data(page)["tokens"] == tokens
    tiny = page_data(show(torch.tensor([[[1.0, 0], [1 - 1e-9, 1e-9]]])).html())["layers"][0]
    assert tiny["lengths"] == [1, 2] and tiny["weights"][0, 1, 1] == SMALLEST / 2  # tiny, but not masked
    fragment = view._repr_html_()
    assert fragment.startswith("<style>") and view.id in fragment and "<html" not in fragment
    assert show(torch.rand(1, 3, 3)).id != view.id  # two views on one notebook page


# --- in a browser -----------------------------------------------------------------------------------------------------


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ModuleNotFoundError:
        return "selenium is not installed (pip install selenium)"
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(path)]
    if missing:
        return (
            f"{' and '.join(missing)} missing: Debian's chromium and chromium-driver packages (`make install` "
            f"installs them when it runs as root)"
        )
    return None


def _browser_required() -> bool:
    return os.environ.get("ATTNLENS_REQUIRE_BROWSER") == "1" or os.environ.get("CI", "").lower() not in (
        "",
        "0",
        "false",
    )


@pytest.fixture(scope="module")
def browser():
    reason = _browser_missing()
    if reason is not None:
        if _browser_required():
            pytest.fail(f"the browser tests must run here (ATTNLENS_REQUIRE_BROWSER=1 or CI is set): {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1100"):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))  # no Selenium Manager, no network
    yield driver
    driver.quit()


def open_page(driver, path):
    driver.get(path.resolve().as_uri())
    errors = [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    assert errors == [], errors
    return driver.find_element("css selector", ".attnlens-view")


def hover_cell(driver, view, row, column, canvas="al-big", cell="cell", fields=("head", "query", "key", "weight")):
    """Move the pointer to the centre of a cell of the large view (or of another canvas, whose centres the page's
    `cell` function gives); return the tooltip's text and data."""
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    big = view.find_element("css selector", f"canvas.{canvas}")
    x, y = driver.execute_script(f"return window.attnlens[{view.get_attribute('id')!r}].{cell}({row}, {column})")
    # bring the cell to the middle of its scrolling box and of the window, then point at it in window coordinates
    at = driver.execute_script(
        """
        const [canvas, x, y] = arguments, box = canvas.parentElement;
        box.scrollLeft = x - box.clientWidth / 2; box.scrollTop = y - box.clientHeight / 2;
        let rect = canvas.getBoundingClientRect();
        window.scrollBy(rect.left + x - window.innerWidth / 2, rect.top + y - window.innerHeight / 2);
        rect = canvas.getBoundingClientRect();
        return [rect.left + x * rect.width / canvas.width, rect.top + y * rect.height / canvas.height];""",
        big,
        x,
        y,
    )
    actions = ActionBuilder(driver)
    actions.pointer_action.move_to_location(int(at[0]), int(at[1]))
    actions.perform()
    tip = view.find_element("css selector", ".al-tip")
    assert tip.is_displayed()
    return tip.text, {key: tip.get_attribute(f"data-{key}") for key in fields}


def pixel_spread(png: bytes) -> float:
    import io

    from PIL import Image, ImageStat

    return max(ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).stddev)


def test_the_viewer_in_a_browser(browser, tmp_path):
    model = tiny("llama")
    prompt = "The cat sat on the mat"
    probs = attnlens.capture_attention(model, prompt, [1, 2], keep="probs")
    path = show(model, prompt, [1, 2]).save(tmp_path / "page.html")
    view = open_page(browser, path)
    assert view.get_attribute("data-heads") == "4" and view.get_attribute("data-tokens") == str(len(prompt))
    assert len(view.find_elements("css selector", "canvas.al-thumb")) == 4
    assert (view.get_attribute("data-queries"), view.get_attribute("data-keys")) == (str(len(prompt)),) * 2
    assert "layer 1" in view.text and "a Llama model" in view.text and prompt in view.text

    text, data = hover_cell(browser, view, 12, 4)  # query 12 'n' (of "on"), key 4 'c' (of "cat")
    assert f'query 12 "{prompt[12]}"' in text and f'key   4 "{prompt[4]}"' in text and "head 0" in text
    assert (data["head"], data["query"], data["key"]) == ("0", "12", "4")
    assert close(float(data["weight"]), probs[1]["probs"][0, 12, 4])

    view.find_elements("css selector", "canvas.al-thumb")[3].click()  # head 3, large
    assert view.get_attribute("data-head") == "3"
    text, data = hover_cell(browser, view, 20, 0)
    assert data["head"] == "3" and close(float(data["weight"]), probs[1]["probs"][3, 20, 0])

    from selenium.webdriver.support.ui import Select

    Select(view.find_element("css selector", "select.al-layer")).select_by_visible_text("2")
    assert view.get_attribute("data-layer") == "2" and view.get_attribute("data-head") == "0"
    text, data = hover_cell(browser, view, 21, 21)
    assert "layer 2" in text and close(float(data["weight"]), probs[2]["probs"][0, 21, 21])

    big = view.find_element("css selector", "canvas.al-big")
    assert pixel_spread(big.screenshot_as_png) > 10  # not blank
    # above the diagonal nothing is attended: white; the heaviest cell of the row is darker than white
    above = browser.execute_script(
        "const c = arguments[0], [x, y] = window.attnlens[arguments[1]].cell(3, 10);"
        "return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data);",
        big,
        view.get_attribute("id"),
    )
    assert above == [255, 255, 255, 255]


def test_a_decode_step_in_a_browser(browser, tmp_path):
    """One query row against a sliding window's keys: the key axis carries the real positions and tokens."""
    tokens = list("abcdefghij")
    step = torch.tensor([[[0.1, 0.2, 0.3, 0.4]], [[0.7, 0.1, 0.1, 0.1]]])  # [2 heads, 1 query, 4 keys]
    path = show(step, layers=3, tokens=tokens, key_positions=[6, 7, 8, 9], title="decode").save(tmp_path / "d.html")
    view = open_page(browser, path)
    assert (view.get_attribute("data-queries"), view.get_attribute("data-keys")) == ("1", "4")
    text, data = hover_cell(browser, view, 0, 1)
    assert (data["query"], data["key"]) == ("9", "7") and 'key   7 "h"' in text and 'query 9 "j"' in text
    assert close(float(data["weight"]), 0.2)


def test_a_thousand_tokens_and_every_head_load_fast(browser, tmp_path):
    """1,000 tokens x 9 heads (SmolLM2's layer width): the page loads and draws well within a second on a desktop; the
    test allows 5 s for a loaded CI machine. docs/viewing.md quotes benchmarks/viewer.py's figure."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(9, 1000, 1000, generator=generator) * 3
    probs = scores.masked_fill(torch.ones(1000, 1000).triu(1).bool(), float("-inf")).softmax(-1)
    path = show(probs, layers=10, tokens=[f"t{i}" for i in range(1000)]).save(tmp_path / "long.html")
    assert path.stat().st_size < 8 * 2**20
    start = time.perf_counter()
    view = open_page(browser, path)
    seconds = time.perf_counter() - start
    assert view.get_attribute("data-heads") == "9" and view.get_attribute("data-tokens") == "1000"
    assert float(view.get_attribute("data-render-ms")) < 5000 and seconds < 10
    _, data = hover_cell(browser, view, 999, 998)
    assert (data["query"], data["key"]) == ("999", "998") and close(float(data["weight"]), probs[0, 999, 998])


def test_two_views_in_one_notebook_page(browser, tmp_path):
    """A notebook shows each view's fragment in one document: each draws its own, neither disturbs the other."""
    one = show(torch.rand(2, 3, 3).softmax(-1), tokens=list("abc"))
    two = show(torch.rand(3, 5, 5).softmax(-1), tokens=list("vwxyz"))
    path = tmp_path / "notebook.html"
    path.write_text(f"<!DOCTYPE html><html><body>{one._repr_html_()}<p>text</p>{two._repr_html_()}</body></html>")
    open_page(browser, path)
    views = browser.find_elements("css selector", ".attnlens-view")
    assert [(v.get_attribute("data-heads"), v.get_attribute("data-tokens")) for v in views] == [("2", "3"), ("3", "5")]
    assert [len(v.find_elements("css selector", "canvas.al-thumb")) for v in views] == [2, 3]
