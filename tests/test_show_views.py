"""Pictures of attention over images of several views and over videos: the labels of their positions, the PNG's
panels (a row per view: LLaVA-NeXT's base view and its stitched tiles, both over the whole image; a row per frame
of a video), and the viewer's canvases and hover in a real browser.

The tiny LLaVA-NeXT as tests/test_vlm_positions.py builds it: a wide 24 x 80 image (base view 4 x 4, tiles 2 x 8,
each row of tiles ended by a newline) and a tall 60 x 20 one (4 x 4, then 8 x 2), through its processor. The tiny
Qwen2-VL with an image of 2 x 2 tokens and a video of 3 frames (temporal patches) of 2 x 3 tokens, as
tests/test_vlm_video.py builds its inputs by hand.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from test_show import browser, close, open_page  # noqa: F401 (browser: the fixture, one Chromium per module)
from test_vlm_video import PROMPT as VIDEO_PROMPT
from test_vlm_video import VIDEO_AT, _types, _video

import attnlens
from attnlens.plot import figure, image_heats
from attnlens.show import patterns

TEXT = "ab<image>cd<image>e"
SIZES = [(24, 80), (60, 20)]


@pytest.fixture(scope="module")
def llava():
    return attnlens.models.tiny("llava_next")


@pytest.fixture(scope="module")
def pictures():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, (*size, 3), dtype=np.uint8) for size in SIZES]


@pytest.fixture(scope="module")
def inputs(pictures):
    from PIL import Image

    images = [Image.fromarray(picture) for picture in pictures]
    return attnlens.models.tiny_processor("llava_next")(text=[TEXT], images=images, return_tensors="pt")


def _pattern(model, inputs, layer=1) -> torch.Tensor:
    """transformers' own attention weights of the language model's layer (eager): [heads, query, key]."""
    ids = inputs["input_ids"]
    rest = {name: value for name, value in inputs.items() if name != "input_ids"}
    with torch.no_grad():
        return model._module(input_ids=ids, **rest, output_attentions=True).attentions[layer][0]


def test_every_position_of_an_image_of_two_views_has_its_own_label(llava, inputs, pictures):
    """LLaVA-NeXT: a base-view token and the tile token at the same row and column are told apart by their view, each
    newline says which image, view and row it ends, and no two image positions share a label. Its pixel_values are
    crops ([images, crops, 3, height, width]), not pictures: the images are given."""
    with pytest.raises(ValueError, match=r"images=: pass the prompt's images .* are not \[images, 3, height"):
        patterns(llava, inputs, [1])
    shown = patterns(llava, inputs, [1], images=pictures)
    found = llava.positions(inputs)
    spans = found.spans()
    base, tiles = found.of_image(0).tolist(), found.of_image(0, view=1).tolist()
    assert shown.tokens[base[1 * 4 + 3]] == "<image 0 view 0 1,3>"
    assert shown.tokens[tiles[1 * 8 + 3]] == "<image 0 view 1 1,3>"
    assert shown.tokens[found.of_image(1, view=1)[7 * 2 + 1]] == "<image 1 view 1 7,1>"
    assert [shown.tokens[p] for p in spans["newline"][:3]] == [
        "<newline image 0 view 1 row 0>",
        "<newline image 0 view 1 row 1>",
        "<newline image 1 view 1 row 0>",
    ]
    on_images = (found.image[0] >= 0).nonzero().flatten().tolist()
    assert len({shown.tokens[p] for p in on_images}) == len(on_images) == 16 + 2 * 9 + 16 + 8 * 3
    assert shown.tokens[0] == "a" and shown.tokens[-1] == "e"


def test_video_tokens_are_labelled_by_frame_and_images_keep_their_one_view_labels():
    """Qwen2-VL, an image of one grid then a video of 3 frames: `<image 0 r,c>` as before, `<video 1 frame f r,c>`."""
    from attnlens.show import labels

    model = attnlens.models.tiny("qwen2_vl")
    inputs = {"pixel_values": torch.zeros(16, 384), "image_grid_thw": torch.tensor([[1, 4, 4]]), **_video(model)}
    found = model.positions(VIDEO_PROMPT, **inputs)
    named = labels(model, VIDEO_PROMPT, found)
    assert named[3:7] == ["<image 0 0,0>", "<image 0 0,1>", "<image 0 1,0>", "<image 0 1,1>"]
    assert [named[p] for p in VIDEO_AT[:7]] == [
        *(f"<video 1 frame 0 {r},{c}>" for r in range(2) for c in range(3)),
        "<video 1 frame 1 0,0>",
    ]
    assert named[VIDEO_AT[-1]] == "<video 1 frame 2 1,2>"


def test_a_class_token_is_labelled_as_its_images_and_the_patches_keep_their_labels():
    """LLaVA under "full": each image's first token is the tower's class token (no place on the grid)."""
    from test_vlm_llava import FULL

    from attnlens.show import labels

    model = attnlens.models.tiny("llava:full")
    named = labels(model, FULL, model.positions(FULL))
    assert named[2:5] == ["<class image 0>", "<image 0 0,0>", "<image 0 0,1>"]
    assert named[20:22] == ["<class image 1>", "<image 1 0,0>"] and named[19] == model.tokenizer.decode([42])


def test_plot_draws_each_view_with_its_own_heat_where_the_attention_says(llava, inputs, pictures):
    """A row of panels per view (image 0's base view, its tiles, image 1's base view, its tiles), each over the whole
    image; the heat of each is transformers' attention from the last row to that view's tokens on that view's grid,
    and the PNG's pixels at each cell's centre are the colour of that weight (drawn over black pictures, so the pixel
    is 0.6 x inferno(weight / largest)). Can fail on a view drawn with another's positions or grid."""
    import matplotlib

    pattern = _pattern(llava, inputs)
    found = llava.positions(inputs)
    black = [np.zeros_like(picture) for picture in pictures]
    shown = patterns(llava, inputs, [1], images=black)
    assert [(i.name, i.grid) for i in shown.images] == [
        ("image 0 view 0", (4, 4)),
        ("image 0 view 1", (2, 8)),
        ("image 1 view 0", (4, 4)),
        ("image 1 view 1", (8, 2)),
    ]
    heats, rows = image_heats(shown, shown.layer(1))
    last = rows[0]
    expected = [
        pattern[:, last, found.of_image(image, view=view)].reshape(-1, *found.views[0][image][view])
        for image in range(2)
        for view in range(2)
    ]
    for heat, hand in zip(heats, expected):
        assert torch.allclose(heat[:-1], hand, atol=1e-6) and torch.allclose(heat[-1], hand.mean(0), atol=1e-6)
    fig = figure(llava, inputs, 1, images=black)
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")  # what plot writes; the axes' pixels are where drawing this canvas put them
    png = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")).astype(float)
    top = max(float(heat.max()) for heat in heats)
    inferno = matplotlib.colormaps["inferno"]
    axes = fig.axes[: 4 * (len(shown.layer(1).heads) + 1)]  # the panels, then the colour bar
    columns = len(shown.layer(1).heads) + 1
    for number, (drawn, hand) in enumerate(zip(shown.images, expected)):
        height, width = drawn.pixels.shape[:2]
        rows_, cols = drawn.grid
        for head in (0, columns - 1):  # the first head's panel and the mean's
            ax = axes[number * columns + head]
            weights = hand[head] if head < columns - 1 else hand.mean(0)
            for r in range(rows_):
                for c in range(cols):
                    x, y = ax.transData.transform(((c + 0.5) * width / cols, (r + 0.5) * height / rows_))
                    pixel = png[png.shape[0] - round(y), round(x)]
                    colour = 0.6 * 255 * np.array(inferno(float(weights[r, c]) / top)[:3])
                    assert np.abs(pixel - colour).max() <= 6, (drawn.name, head, r, c, pixel, colour)


def test_plot_draws_a_videos_frames_each_on_its_own_frame():
    """Qwen2-VL, a video given as its 6 frames (3 temporal patches): a row per frame, drawn on the first frame each
    covers, its heat the attention to that frame's tokens."""
    model = attnlens.models.tiny("qwen2_vl")
    image = torch.randn(16, 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(1))
    inputs = {
        "input_ids": VIDEO_PROMPT,
        "pixel_values": image,
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        **_video(model),
        "mm_token_type_ids": _types(VIDEO_PROMPT),
    }
    frames = [np.full((32, 48, 3), 40 * f, dtype=np.uint8) for f in range(6)]
    shown = patterns(model, inputs, [1], images=[np.zeros((32, 32, 3), dtype=np.uint8), frames])
    assert [i.name for i in shown.images] == ["image 0", "video 1 frame 0", "video 1 frame 1", "video 1 frame 2"]
    assert [int(i.pixels[0, 0, 0]) for i in shown.images[1:]] == [0, 80, 160]  # frames 0, 2, 4
    heats, (last,) = image_heats(shown, shown.layer(1))
    pattern = shown.layer(1).probs
    for frame in range(3):
        hand = pattern[:, last, VIDEO_AT[6 * frame : 6 * frame + 6]].reshape(-1, 2, 3)
        assert torch.equal(heats[1 + frame][:-1], hand)
    with pytest.raises(ValueError, match="images= gives 1 images for a prompt holding 2"):
        patterns(model, inputs, [1], images=[frames])
    with pytest.raises(ValueError, match="images=: entry 1 is a video; pass its frames"):
        patterns(model, inputs, [1], images=[frames[0], frames[0]])


@pytest.mark.xdist_group("browser")
def test_the_viewer_draws_each_view_and_hovering_a_tile_or_a_frame_names_it(
    llava,
    inputs,
    pictures,
    browser,  # noqa: F811 (the fixture imported above)
    tmp_path,
):
    """In a real browser: a canvas per view (4 for two LLaVA-NeXT images); hovering a patch of image 0's tiles reports
    image 0, view 1, its row and column, its key and the weight transformers gives it; on a Qwen2-VL video, a patch
    of frame 2 reports the video, the frame, row and column."""
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    pattern = _pattern(llava, inputs)
    found = llava.positions(inputs)
    view = open_page(browser, attnlens.show(llava, inputs, layers=[1], images=pictures).save(tmp_path / "views.html"))

    def point(view, index, row, column):
        identity = view.get_attribute("id")
        canvas = view.find_elements("css selector", "canvas.al-image")[index]
        x, y = browser.execute_script(f"return window.attnlens[{identity!r}].patch({index}, {row}, {column})")
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
        fields = ("image", "view", "frame", "row", "col", "key", "weight")
        return tip.text, {key: tip.get_attribute(f"data-{key}") for key in fields}

    assert len(view.find_elements("css selector", "canvas.al-image")) == 4
    last = inputs["input_ids"].shape[1] - 1
    text, data = point(view, 1, 1, 3)  # image 0's tiles, row 1, column 3
    key = int(found.of_image(0, view=1)[1 * 8 + 3])
    assert (data["image"], data["view"], data["frame"], data["row"], data["col"]) == ("0", "1", None, "1", "3")
    assert data["key"] == str(key) and close(float(data["weight"]), pattern[0, last, key])
    assert "image 0 view 1 row 1 col 3" in text
    text, data = point(view, 2, 3, 0)  # image 1's base view
    assert (data["image"], data["view"], data["row"], data["col"]) == ("1", "0", "3", "0")
    assert data["key"] == str(int(found.of_image(1)[12]))
    captions = [c.text for c in view.find_elements("css selector", ".al-images figcaption")]
    names = ["image 0 view 0", "image 0 view 1", "image 1 view 0", "image 1 view 1"]
    assert [caption.split(" \u00b7 ")[0] for caption in captions] == names

    model = attnlens.models.tiny("qwen2_vl")
    qwen = {
        "input_ids": VIDEO_PROMPT,
        "pixel_values": torch.randn(16, 384, generator=torch.Generator().manual_seed(1)),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        **_video(model),
        "mm_token_type_ids": _types(VIDEO_PROMPT),
    }
    frames = np.zeros((6, 32, 48, 3), dtype=np.uint8)
    page = attnlens.show(model, qwen, layers=[1], images=[np.zeros((32, 32, 3), dtype=np.uint8), frames])
    view = open_page(browser, page.save(tmp_path / "video.html"))
    assert len(view.find_elements("css selector", "canvas.al-image")) == 4
    text, data = point(view, 3, 1, 2)  # the video's frame 2, row 1, column 2
    assert (data["image"], data["frame"], data["view"], data["row"], data["col"]) == ("1", "2", None, "1", "2")
    assert data["key"] == str(VIDEO_AT[-1]) and "video 1 frame 2 row 1 col 2" in text
