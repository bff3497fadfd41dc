"""Vision-language models on the transformers engine: prompts with images, what each position is, the vision tower's
own attention, against transformers' own attention weights and the identities.

The tiny Gemma 3 multimodal model (`models.tiny("gemma3")`): a 2-block SigLIP tower over 32 x 32 images (4 x 4
patches of 8 pixels, pooled to 2 x 2 image tokens), a 3-block language model whose image tokens (id 129, between
130 and 131) attend to each other both ways.
"""

from __future__ import annotations

import pytest
import torch
from images import logits_with_uniform_tower_attention
from test_show import browser, close, open_page  # noqa: F401 (browser: the fixture, one Chromium per module)

import attnlens
from attnlens.analysis import knock_out
from attnlens.checks import failures, read_everything

IMAGE, START, END = 129, 130, 131
#: Text, an image, text, a second image, text.
PROMPT = torch.tensor([[1, 40, 41, START, *[IMAGE] * 4, END, 42, START, *[IMAGE] * 4, END, 43, 44]])
FIRST, SECOND = [4, 5, 6, 7], [11, 12, 13, 14]


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("gemma3")


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _inputs(pixels):
    return {"pixel_values": pixels, "token_type_ids": (PROMPT == IMAGE).long()}


def test_every_pattern_of_both_stacks_equals_transformers_attention_on_a_prompt_with_two_images(model, pixels):
    """The language model's patterns (image rows included, where Gemma 3 attends both ways) and the vision tower's
    (one per image) are torch.equal to `output_attentions`; the logits equal the model's."""
    with torch.no_grad():
        own = model._module(input_ids=PROMPT, output_attentions=True, **_inputs(pixels))
        tower = model._module.model.vision_tower(pixels, output_attentions=True)
    vision, language = [], []
    with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
        for i in range(2):
            vision.append(model.vision.layers[i].self_attn.attention_probabilities.save())
        for i in range(3):
            language.append(model.layers[i].self_attn.attention_probabilities.save())
        logits = model.logits.save()
    assert all(torch.equal(found, expected) for found, expected in zip(vision, tower.attentions))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    assert vision[0].shape == (2, 2, 16, 16)  # two images, two heads, 16 patches each way
    first = language[1][0, :, FIRST][..., FIRST]
    assert (first > 0).all()  # an image's tokens see each other both ways: above the diagonal too
    assert (language[1][0, :, FIRST][..., SECOND] == 0).all()  # not a later image


def test_the_identities_hold_on_both_stacks_with_images(model, pixels):
    """Every identity of every block of the tower and of the language model on the two-image prompt: the masked
    entries are the model's (an image's tokens both ways), the scores the family's score function's with them."""
    saved = read_everything(model, PROMPT, **_inputs(pixels))
    assert [failures(model.vision, saved["vision"], i) for i in range(model.vision.num_layers)] == [[], []]
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]
    together = saved["image_of"][0, FIRST[0]] == saved["image_of"][0, FIRST[-1]] == 0
    assert together


def test_the_causal_mask_would_be_wrong_on_image_rows(model, pixels):
    """Can fail: without the image positions the checks hold the image rows to the causal mask, and fail."""
    saved = read_everything(model, PROMPT, **_inputs(pixels))
    del saved["image_of"]
    assert "masked entries exactly zero" in failures(model, saved, 0)


def test_positions_place_every_image_token_on_its_images_grid(model, pixels):
    """Each position's kind, image, row and column; `on_grid` puts a row of a pattern onto an image's 2 x 2 grid."""
    found = model.positions(PROMPT, **_inputs(pixels))
    spans = {"text": [0, 1, 2, 9, 16, 17], "special": [3, 8, 10, 15], "image 0": FIRST, "image 1": SECOND}
    assert found.spans() == spans
    assert found.grids == (((2, 2), (2, 2)),)
    assert found.row[0, FIRST].tolist() == [0, 0, 1, 1] and found.col[0, SECOND].tolist() == [0, 1, 0, 1]
    row = torch.arange(PROMPT.shape[1], dtype=torch.float32)
    assert found.on_grid(row, 1).tolist() == [[11.0, 12.0], [13.0, 14.0]]
    assert list(found.frame().columns) == ["position", "kind", "image", "row", "col"]
    with pytest.raises(ValueError, match="image 1 of prompt 0 has 3 image tokens"):
        model.positions(PROMPT[:, :14])
    assert (attnlens.models.tiny("llama").positions(torch.tensor([5, 6, 7])).kind == 0).all()


def test_the_sdpa_rebuild_sees_an_images_tokens_both_ways(pixels):
    """On sdpa with `rebuild_patterns`, the pattern rebuilt from the queries and keys with the model's mask equals
    the eager pattern (image rows too) within 1e-6."""
    eager = attnlens.models.tiny("gemma3")
    sdpa = attnlens.models.tiny("gemma3", attn_implementation="sdpa", rebuild_patterns=True)

    def patterns(model):
        with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
            first = model.layers[0].self_attn.attention_probabilities.save()
            second = model.layers[1].self_attn.attention_probabilities.save()
        return first, second

    for found, expected in zip(patterns(sdpa), patterns(eager)):
        assert torch.allclose(found, expected, atol=1e-6)
        assert (found[0, :, FIRST[0], FIRST[-1]] > 0).all()


def test_reads_in_forward_order_the_tower_then_the_language_model(model, pixels):
    """The tower runs before the language model's blocks: `model.vision...` then `model.embeddings` (what layers[0]
    reads: the image features in the image tokens' rows) is forward order, and the reverse is refused by name."""
    with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
        patches = model.vision.embeddings.save()
        embeddings = model.embeddings.save()
        first = model.layers[0].layer_input.save()
    assert patches.shape == (2, 16, 32)
    assert torch.equal(embeddings, first)
    assert not torch.equal(embeddings[0, FIRST[0]], embeddings[0, FIRST[1]])  # each image token its own features
    with pytest.raises(attnlens.OrderError, match="vision"):
        with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
            model.embeddings.save()
            model.vision.layers[0].self_attn.attention_probabilities.save()


def test_an_edit_of_the_towers_pattern_moves_the_logits_as_recomputing_by_hand_predicts(model, pixels):
    """Uniform attention in the tower's last block: the logits equal a hand-run of the model with that block's
    attention replaced by the mean of its values; the tower's support says what it serves and why not logits."""
    last = model.vision.layers[-1]
    with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
        pattern = last.self_attn.attention_probabilities
        last.self_attn.attention_probabilities = torch.full_like(pattern, 1 / pattern.shape[-1])
        edited = model.logits.save()
    expected = logits_with_uniform_tower_attention(model, -1, PROMPT, **_inputs(pixels))
    assert torch.allclose(edited, expected, atol=1e-5)
    support = model.vision.support(0)
    assert support["self_attn.attention_probabilities"] is None
    assert "no logits" in support["logits"]


# --- pictures -------------------------------------------------------------------------------------------------------


def test_plot_lays_each_heads_attention_from_the_chosen_rows_over_each_image(model, pixels, tmp_path):
    """The heat over image 1 for head h is the pattern's row (or the mean of rows) at image 1's tokens, on its 2 x 2
    grid; the last panel is the heads' mean; the PNG is written, and a text prompt refuses `rows=`."""
    from attnlens.plot import image_heats
    from attnlens.show import patterns

    inputs = {"input_ids": PROMPT, **_inputs(pixels)}
    with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
        pattern = model.layers[1].self_attn.attention_probabilities.save()
    shown = patterns(model, inputs, [1])
    assert shown.tokens[FIRST[1]] == "<image 0 0,1>" and len(shown.images) == 2
    assert shown.images[1].positions == SECOND and shown.images[0].pixels.shape == (32, 32, 3)
    heats, rows = image_heats(shown, shown.layer(1), rows=[-1, -2])
    assert rows == [17, 16]
    expected = pattern[0, :, [17, 16]][..., SECOND].mean(1).reshape(4, 2, 2)
    assert torch.allclose(heats[1][:4], expected, atol=1e-7)
    assert torch.allclose(heats[1][4], expected.mean(0), atol=1e-7)
    out = attnlens.plot(model, inputs, 1, out=tmp_path / "over.png", rows=9)
    assert out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="rows= picks the text rows"):
        attnlens.plot(model, PROMPT[0, :3], 1, out=tmp_path / "text.png", rows=1)
    with pytest.raises(ValueError, match="images= gives 1 images for a prompt holding 2"):
        patterns(model, inputs, [1], images=[torch.zeros(8, 8, 3, dtype=torch.uint8)])


@pytest.mark.any_transformers
@pytest.mark.xdist_group("browser")
def test_the_viewer_shows_each_image_with_the_enlarged_heads_attention_from_a_query_row(
    model,
    pixels,
    browser,  # noqa: F811 (the fixture imported above)
    tmp_path,
):
    """In a real browser: one canvas per image; hovering a patch gives its image, row, column, key and the weight of
    the enlarged head from the query row the pointer last crossed in the pattern (the last row until then)."""
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    inputs = {"input_ids": PROMPT, **_inputs(pixels)}
    with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
        pattern = model.layers[1].self_attn.attention_probabilities.save()
    view = open_page(browser, attnlens.show(model, inputs, layers=[1]).save(tmp_path / "images.html"))
    canvases = view.find_elements("css selector", "canvas.al-image")
    assert len(canvases) == 2 and view.get_attribute("data-image-query") == "17"
    identity = view.get_attribute("id")

    def point(canvas, x, y):
        at = browser.execute_script(
            "const [c, x, y] = arguments; c.scrollIntoView({block: 'center'}); const r = c.getBoundingClientRect();"
            "return [r.left + x * r.width / c.width, r.top + y * r.height / c.height];",
            canvas,
            x,
            y,
        )
        actions = ActionBuilder(browser)
        actions.pointer_action.move_to_location(int(at[0]), int(at[1]))
        actions.perform()
        tip = view.find_element("css selector", ".al-tip")
        return tip.text, {key: tip.get_attribute(f"data-{key}") for key in ("image", "row", "col", "key", "weight")}

    x, y = browser.execute_script(f"return window.attnlens[{identity!r}].patch(1, 1, 0)")
    text, data = point(canvases[1], x, y)
    assert (data["image"], data["row"], data["col"], data["key"]) == ("1", "1", "0", str(SECOND[2]))
    assert close(float(data["weight"]), pattern[0, 0, 17, SECOND[2]]) and "query 17" in text
    big = view.find_element("css selector", "canvas.al-big")
    x, y = browser.execute_script(f"return window.attnlens[{identity!r}].cell(9, 0)")  # row 9: text after image 0
    point(big, x, y)
    assert view.get_attribute("data-image-query") == "9"
    canvases = view.find_elements("css selector", "canvas.al-image")
    x, y = browser.execute_script(f"return window.attnlens[{identity!r}].patch(0, 0, 1)")
    text, data = point(canvases[0], x, y)
    assert data["key"] == str(FIRST[1]) and close(float(data["weight"]), pattern[0, 0, 9, FIRST[1]])


def test_attnlens_show_with_an_image_writes_the_page_and_the_png_through_the_models_processor(tmp_path):
    """`attnlens show MODEL PROMPT --image FILE`: the processor (the tiny model's, built locally) puts the image's
    tokens in the prompt; the page carries the image on its 2 x 2 grid, the PNG is written; a missing file and a
    text model's refusal are one line each."""
    import cli_run
    from PIL import Image

    picture = tmp_path / "picture.png"
    Image.fromarray((torch.rand(24, 40, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy()).save(
        picture
    )
    page = tmp_path / "page.html"
    run = cli_run.attnlens(
        "show", "tiny:gemma3", "Describe this.", "--image", str(picture), "--layer", "0,1", "--out", str(page)
    )
    assert run.returncode == 0, run.stderr
    from test_show import page_data

    data = page_data(page.read_text())
    assert len(data["images"]) == 1 and (data["images"][0]["rows"], data["images"][0]["cols"]) == (2, 2)
    assert (data["images"][0]["width"], data["images"][0]["height"]) == (40, 24)  # the picture itself, not resized
    assert data["tokens"][data["images"][0]["positions"][3]] == "<image 0 1,1>"
    png = tmp_path / "over.png"
    run = cli_run.attnlens(
        "show", "tiny:gemma3", "Describe this.", "--image", str(picture), "--layer", "1", "--out", str(png)
    )
    assert run.returncode == 0 and png.stat().st_size > 5_000
    run = cli_run.attnlens(
        "show", "tiny:gemma3", "x", "--image", str(tmp_path / "none.png"), "--layer", "1", "--out", str(png)
    )
    assert run.returncode != 0 and "--image" in run.stderr and "none.png" in run.stderr
    run = cli_run.attnlens("show", "tiny:llama", "x", "--image", str(picture), "--layer", "1", "--out", str(png))
    assert run.returncode != 0 and "no processor that takes images" in run.stderr


# --- analyses -------------------------------------------------------------------------------------------------------


def test_attribution_of_a_prompt_with_images_adds_up_and_says_how_much_came_from_each_image(model, pixels):
    """Attribution takes the model's inputs: the pieces add up to the logit, image tokens are labelled, and
    `by_span` sums the head pieces from each image's tokens (equal to the pieces at those sources by hand); the
    spans of every position add up to all head pieces; another second image moves only what depends on it."""
    inputs = {"input_ids": PROMPT, **_inputs(pixels)}
    found = attnlens.attribution(model, inputs, target=5)
    assert torch.allclose(found.total, found.value, atol=1e-4)
    assert found.tokens[SECOND[0]] == "<image 1 0,0>"
    spans = model.positions(inputs).spans()
    shares = found.by_span(spans)
    by_hand = sum(pieces[0, :, SECOND].sum() for pieces in found.heads.values())
    assert torch.allclose(shares["image 1"], by_hand.reshape(1), atol=1e-6)
    every = sum(pieces.sum((1, 2)) for pieces in found.heads.values())
    assert torch.allclose(sum(shares.values()), every, atol=1e-5)
    other = pixels.clone()
    other[1] = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(5))
    moved = attnlens.attribution(model, {**inputs, "pixel_values": other}, target=5).by_span(spans)
    assert not torch.allclose(moved["image 1"], shares["image 1"], atol=1e-4)


def test_knocking_out_text_rows_reading_the_images_makes_the_last_logits_blind_to_the_pixels(model, pixels):
    """With every layer's text rows forbidden to read any image token (`knock_out` with `positions`), the text
    positions' logits are the same whatever the images are; without it they differ."""
    found = model.positions(PROMPT)
    spans = found.spans()
    images = spans["image 0"] + spans["image 1"]
    text = [p for p in range(PROMPT.shape[1]) if p not in images]
    other = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))

    def logits(pixel_values, knock):
        with torch.no_grad(), model.trace(PROMPT, pixel_values=pixel_values, token_type_ids=(PROMPT == IMAGE).long()):
            if knock:
                for layer in range(model.num_layers):
                    knock_out(model, layer, queries=text, keys=images)
            out = model.logits.save()
        return out[0, text]

    assert torch.allclose(logits(pixels, True), logits(other, True), atol=1e-5)
    assert not torch.allclose(logits(pixels, False), logits(other, False), atol=1e-3)


def test_patching_image_token_positions_from_one_image_into_another_equals_a_hand_run(model, pixels):
    """`patch` over the residual positions of two prompts differing only in their second image: each cell is the
    metric of the corrupted run with that position's block input taken from the clean run, as a hand-written trace
    computes it; text positions before the second image change nothing."""
    from attnlens.analysis import patch

    clean = {"input_ids": PROMPT, **_inputs(pixels)}
    other = pixels.clone()
    other[1] = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(9))
    corrupt = {"input_ids": PROMPT, **_inputs(other)}

    def metric(logits):
        return logits[:, -1, 5] - logits[:, -1, 6]

    grid = patch(model, clean, corrupt, metric, over="residual", layers=[1], batch_size=8)
    with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
        source = model.layers[1].layer_input.save()
    for position in (SECOND[0], SECOND[3], 9):
        with torch.no_grad(), model.trace(PROMPT, **_inputs(other)):
            stream = model.layers[1].layer_input
            stream[0, position] = source[0, position]
            by_hand = metric(model.logits).save()
        assert torch.allclose(grid.values[0, position], by_hand[0], atol=1e-5), position
    assert grid.values[0, 9] == pytest.approx(grid.corrupt, abs=1e-6)  # before the second image: same in both
    assert grid.clean != pytest.approx(grid.corrupt, abs=1e-3)
