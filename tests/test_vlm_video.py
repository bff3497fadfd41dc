"""Videos on Qwen2-VL and Qwen2.5-VL (transformers engine): what each position of a prompt with a video is (each
frame a view of the video), the language model's values against `output_attentions` under the model's M-RoPE ids
on video tokens, and Qwen's ViT on a video (a segment per frame, windows within frames) against a hand computation.

The tiny models (`models.tiny("qwen2_vl")`, `models.tiny("qwen2_5_vl")`, as tests/test_vlm_qwen.py): patches of 8
pixels and 2 frames (`temporal_patch_size`), merged 2 x 2 into tokens. The video: 6 frames of 32 x 48 pixels, so
`video_grid_thw` (3, 4, 6): 3 temporal patches ("frames" below) of 4 x 6 patches, each 2 x 3 tokens of
`video_token_id` (128), 18 in all, between 130 and 131. Its inputs are built by hand: transformers 5.25's
Qwen2VLVideoProcessor needs torchvision, which is not installed; `pixel_values_videos` is one row per patch,
[t * h * w, C * temporal_patch_size * P * P] = [72, 3 * 2 * 8 * 8], the shape the processor gives where it runs
without torchvision (transformers 5.19: checked below) and the model's patch embedding reads.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import attnlens
from attnlens.checks import failures, read_everything

VIDEO, IMAGE, START, END = 128, 129, 130, 131
FRAMES, ROWS, COLS = 3, 2, 3  # the video's temporal patches, each 2 x 3 tokens
THW = torch.tensor([[FRAMES, 2 * ROWS, 2 * COLS]])
#: Text, an image of 2 x 2 tokens, text, the video, text.
PROMPT = torch.tensor([[1, 40, START, *[IMAGE] * 4, END, 41, START, *[VIDEO] * (FRAMES * ROWS * COLS), END, 42]])
IMAGE_AT = [3, 4, 5, 6]
VIDEO_AT = list(range(10, 28))
#: The video alone: text, the video, text.
ALONE = torch.tensor([[1, 40, START, *[VIDEO] * (FRAMES * ROWS * COLS), END, 42]])
PATCHES = FRAMES * 4 * 6
TYPES = ["qwen2_vl", "qwen2_5_vl"]


@pytest.fixture(scope="module", params=TYPES)
def model(request):
    return attnlens.models.tiny(request.param)


def _types(prompt):
    """The processor's `mm_token_type_ids`: 1 on image tokens, 2 on video tokens."""
    return torch.where(prompt == IMAGE, 1, torch.where(prompt == VIDEO, 2, 0))


def _video(model) -> dict:
    generator = torch.Generator().manual_seed(0)
    found = {"pixel_values_videos": torch.randn(PATCHES, 3 * 2 * 8 * 8, generator=generator), "video_grid_thw": THW}
    if model.config.model_type == "qwen2_5_vl":
        found["second_per_grid_ts"] = torch.tensor([0.5])  # 2 frames at 4 fps: temporal ids 4 * 0.5 = 2 apart
    return found


@pytest.fixture(scope="module")
def both(model):
    """The image and the video: the tower runs on the image, then on the video."""
    image = torch.randn(16, 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(1))
    return {"pixel_values": image, "image_grid_thw": torch.tensor([[1, 4, 4]]), **_video(model)}


@pytest.fixture(scope="module")
def alone(model):
    return _video(model)


def test_the_hand_built_video_inputs_have_the_processors_shapes():
    """Where Qwen2VLVideoProcessor runs without torchvision (transformers 5.19), its output for 6 frames of 32 x 48
    has the shapes built by hand here."""
    import numpy as np
    import transformers

    try:
        processor = transformers.Qwen2VLVideoProcessor(
            patch_size=8, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 256, "longest_edge": 4096}
        )
    except ImportError as error:
        pytest.skip(f"transformers {transformers.__version__}'s video processor: {str(error).strip().splitlines()[0]}")
    frames = np.random.default_rng(0).integers(0, 255, (6, 32, 48, 3), dtype=np.uint8)
    out = processor(videos=[frames], return_tensors="pt")
    assert out["pixel_values_videos"].shape == (PATCHES, 3 * 2 * 8 * 8)
    assert out["video_grid_thw"].tolist() == THW.tolist()


def test_positions_place_each_frame_of_the_video_as_a_view(model, both):
    """The image is image 0 (one 2 x 2 view), the video image 1: kind "video", three views (its frames) of 2 x 3,
    frame after frame, row-major."""
    found = model.positions(PROMPT, **both)
    assert found.spans() == {
        "text": [0, 1, 8, 29],
        "special": [2, 7, 9, 28],
        "image 0": IMAGE_AT,
        "video 1": VIDEO_AT,
    }
    assert found.views == ((((2, 2),), ((ROWS, COLS),) * FRAMES),)
    assert found.grids == (((2, 2), (ROWS, COLS)),)
    assert found.view[0, VIDEO_AT].tolist() == [f for f in range(FRAMES) for _ in range(ROWS * COLS)]
    assert found.row[0, VIDEO_AT].tolist() == [0, 0, 0, 1, 1, 1] * FRAMES
    assert found.col[0, VIDEO_AT].tolist() == [0, 1, 2] * 2 * FRAMES
    values = torch.arange(PROMPT.shape[1])
    assert found.on_grid(values, 1, view=2).tolist() == [[22, 23, 24], [25, 26, 27]]
    assert list(found.frame().columns) == ["position", "kind", "image", "view", "row", "col"]
    with pytest.raises(ValueError, match="video 1 of prompt 0 has 17 video tokens"):
        model.positions(PROMPT[:, :27], **both)
    with pytest.raises(ValueError, match="pass video_grid_thw"):
        model.positions(ALONE, pixel_values_videos=both["pixel_values_videos"])


def test_the_layout_predicts_the_models_m_rope_ids_on_the_video(model, both):
    """Can fail on any frame, row or column: the model's own M-RoPE ids (`get_rope_index`) on each video token are
    (start + frame * interval, start + row, start + column), the start the position after the text before it and
    the interval 1 on Qwen2-VL, `tokens_per_second * second_per_grid_ts` on Qwen2.5-VL; the text after the video
    counts on from start + max(rows, columns), not from its last frame."""
    found = model.positions(PROMPT, **both)
    grids = {"image_grid_thw": both["image_grid_thw"], "video_grid_thw": THW}
    if "second_per_grid_ts" in both:
        grids["second_per_grid_ts"] = both["second_per_grid_ts"]
    rope, _ = model._module.model.get_rope_index(PROMPT, _types(PROMPT), **grids)
    start = int(rope[0, 0, VIDEO_AT[0] - 1]) + 1
    interval = 1 if "second_per_grid_ts" not in both else 4 * 0.5
    view, row, col = (t[0, VIDEO_AT] for t in (found.view, found.row, found.col))
    expected = torch.stack([start + (view * interval).long(), start + row, start + col])
    assert torch.equal(rope[:, 0, VIDEO_AT], expected)
    assert rope[:, 0, VIDEO_AT[-1] + 1].tolist() == [start + max(ROWS, COLS)] * 3


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image and video"])
def test_every_language_pattern_equals_transformers_attention_on_a_video(model, both, alone, with_image):
    """The language model's patterns with the video (its tokens rotated by the model's M-RoPE ids, causal) are
    torch.equal to `output_attentions`, the logits to the model's; the identities of every block hold."""
    prompt, inputs = (PROMPT, both) if with_image else (ALONE, alone)
    inputs = {**inputs, "mm_token_type_ids": _types(prompt)}
    with torch.no_grad():
        own = model._module(input_ids=prompt, output_attentions=True, **inputs)
    language = []
    with torch.no_grad(), model.trace(prompt, **inputs):
        for i in range(model.num_layers):
            language.append(model.layers[i].self_attn.attention_probabilities.save())
        logits = model.logits.save()
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    saved = read_everything(model, prompt, **inputs)
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[]] * model.num_layers


def _tower_run(model, inputs):
    """Per tower block, the arguments the model called its attention with (input, `cu_seqlens`, rotary), on the
    video alone, and the tower's output."""
    seen = {}

    def keep(index):
        def hook(module, args, kwargs):
            seen[index] = (args[0], kwargs["cu_seqlens"], kwargs["position_embeddings"])

        return hook

    visual = model._module.model.visual
    handles = [block.attn.register_forward_pre_hook(keep(i), with_kwargs=True) for i, block in enumerate(visual.blocks)]
    try:
        with torch.no_grad():
            tower = visual(inputs["pixel_values_videos"], grid_thw=THW)
    finally:
        for handle in handles:
            handle.remove()
    return tower, seen


def test_the_towers_attention_on_a_video_is_one_softmax_per_frame_or_window(model, alone):
    """The tower on the video alone: `segments` (the score function's, the checks') are the model's own
    `cu_seqlens` on every block: a segment per frame (Qwen2-VL; Qwen2.5-VL's full-attention block), per window of a
    frame on Qwen2.5-VL's windowed blocks (each frame's 4 x 6 patches two windows, 16 and 8 patches); each block's
    scores and pattern equal a hand computation per segment (1e-5), exact zeros off it; the last block's output is
    the tower's (torch.equal); every identity holds."""
    from importlib import import_module

    inputs = {**alone, "mm_token_type_ids": _types(ALONE)}
    tower, seen = _tower_run(model, inputs)
    rotate = import_module(type(model._module).__module__).apply_rotary_pos_emb_vision
    read = {}
    with torch.no_grad(), model.trace(ALONE, **inputs):
        for i in range(model.vision.num_layers):
            attn = model.vision.layers[i].self_attn
            read[i] = [attn.attention_scores.save(), attn.attention_probabilities.save()]
        last = model.vision.layers[-1].layer_output.save()
    assert torch.equal(last[0], tower.last_hidden_state)
    counts = []
    for i, block in enumerate(model._module.model.visual.blocks):
        scores, pattern = read[i]
        hidden, cu, (cos, sin) = seen[i]
        ids = model.vision.family.segments(model.vision.config, inputs, i)[0]
        assert torch.equal(torch.bincount(ids).cumsum(0), cu[1:].long())  # the model's own segments
        attn = block.attn
        with torch.no_grad():
            raw = attn.qkv(hidden).reshape(PATCHES, 3, attn.num_heads, -1).permute(1, 0, 2, 3)
            q, k = (t.transpose(0, 1) for t in rotate(raw[0], raw[1], cos, sin))
        expected = torch.zeros_like(pattern)
        for start, end in itertools.pairwise(cu.tolist()):
            own = q[:, start:end] @ k[:, start:end].transpose(-1, -2) * attn.scaling
            assert torch.allclose(scores[0, :, start:end, start:end], own, atol=1e-5)
            expected[0, :, start:end, start:end] = own.softmax(-1)
        assert torch.allclose(pattern, expected, atol=1e-5) and (pattern[expected == 0] == 0).all()
        counts.append(len(cu) - 1)
    assert counts == ([FRAMES] * 2 if model.config.model_type == "qwen2_vl" else [2 * FRAMES, FRAMES, 2 * FRAMES])
    saved = read_everything(model, ALONE, **inputs)
    tower_blocks = model.vision.num_layers
    assert [failures(model.vision, saved["vision"], i) for i in range(tower_blocks)] == [[]] * tower_blocks


def test_with_an_image_and_a_video_the_tower_serves_its_first_run_the_images(model, both):
    """The model runs its tower on the images, then on the videos: a trace reads the first run (the image's 16
    patches), and its segments are the image's."""
    inputs = {**both, "mm_token_type_ids": _types(PROMPT)}
    with torch.no_grad():
        image = model._module.model.visual(both["pixel_values"], grid_thw=both["image_grid_thw"])
    with torch.no_grad(), model.trace(PROMPT, **inputs):
        last = model.vision.layers[-1].layer_output.save()
    assert torch.equal(last[0], image.last_hidden_state)
    assert model.vision.family.segments(model.vision.config, inputs, 0).shape == (1, 16)
