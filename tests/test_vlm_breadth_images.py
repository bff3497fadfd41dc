"""The image-text-to-text types whose language model attnlens serves without laying out their images (the "text"
lists of tests/test_vlm_breadth.py: a family, or the common layout `attnlens.inferred` infers), on a prompt with an
image: each built tiny from its config classes (the survey's sizes, `tools.survey.build.tiny_kwargs`, a small vision
tower), given an image as its forward takes it (no hub processor: the pixel inputs its vision config expects, and
input_ids with as many image tokens as the model's own `get_image_features` returns), on the transformers engine.

On each, every served value of the language model is read in one trace (`attnlens.checks.read_everything`): each
block's attention probabilities torch.equal transformers' `output_attentions` (eager), its input equal to the
model's hidden states, the final norm's output and the logits equal, and every identity holds
(`attnlens.checks.failures`: the mask identities hold the image tokens' rows to the family's causal mask). A family
whose model differs there (a mask the family does not describe) refuses its values on a prompt with images
(`LanguageModelOf.refuses_images`), with the measured reason; the test holds the refusal to the measurement.

The types served with images by families of their own (towers, image layouts) are held to transformers by their
own tests, tests/test_vlm_*.py.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers

from attnlens import StandardizedTransformer
from attnlens.checks import failures, read_everything
from attnlens.errors import Unavailable
from attnlens.models import _perturbed, char_tokenizer
from attnlens.vision_types import CHECKED_WITH_IMAGES, image_text_types

#: The survey's sizes are transformers 5.25's registry; 5.19 lacks some types (skipped) and spells some inputs
#: otherwise (`make test-eager-vllm` deselects the breadth tests)
pytestmark = pytest.mark.any_transformers

#: The image token's id in every tiny model (below the tiny vocabulary's 128), and the ids of the tokens some types
#: put around an image.
IMAGE, START, END = 100, 101, 102

#: Refused on a prompt with images (`LanguageModelOf.refuses_images`): the start of each family's reason, which the
#: test holds to its measurement (what the identities find with the refusal lifted).
REFUSED = {
    "git": "GIT prepends the image's tokens to the text",
}
#: Not traced with an image here, and why.
NOT_RUN = {
    # AutoModelForCausalLM loads a dots.3 Note checkpoint as its text model (the towers dropped), which the Dots3Note
    # family serves; the image-text-to-text class itself has no family (its blocks are model.language_model's). Tried
    # here: Dots3Note under LanguageModelOf fails the load-time verification on its indexed layers (visible entries
    # positive, scores), so a composite family is left to a change of its own
    "dots3_note": "the Dots3Note family serves the text model AutoModelForCausalLM loads, not "
    "Dots3NoteForConditionalGeneration",
}

#: Every "text" type of tests/test_vlm_breadth.py but those laid out elsewhere (`test_the_counts`).
TYPES = [*CHECKED_WITH_IMAGES, *NOT_RUN]

#: M-RoPE sections that fit the tiny head_dim 16 (their sum is half of it).
MROPE = {"text_config": {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}}}
#: Config keyword arguments over the survey's sizes, per type: a small image (few image tokens), sizes the survey's
#: do not fit (a projector keyed by the patch count, a rotary split by section), ids a prompt needs.
CONFIG: dict[str, dict] = {
    # images are a VQ tokenizer's codes, embedded by the text embeddings from image_token_offset on (audio's after):
    # a small tokenizer (a 32-code book, 2x downsampling: an 8 x 8 image is 16 codes) whose ranges fit the vocabulary
    "apertus1p5": {
        "vision_config": {
            "codebook_size": 32,
            "embed_dim": 8,
            "latent_channels": 32,
            "base_channels": 32,
            "channel_multiplier": [1, 2],
            "num_res_blocks": 1,
            "attn_resolutions": [],
            "resolution": 8,
        },
        "audio_config": {
            "codebook_dim": 32,
            "codebook_size": 16,
            "num_filters": 4,
            "upsampling_ratios": [2, 2],
            "num_lstm_layers": 1,
        },
        "image_token_offset": 32,
        "audio_token_offset": 64,
    },
    # the projector maps a patch count to a query count: 16 patches of a 64 x 64 image to 4 queries
    "aria": {"vision_config": {"image_size": 64, "patch_size": 16}, "projector_patch_to_query_dict": {16: 4}},
    "cosmos3_edge": MROPE,
    "deepseek_vl": {"vision_config": {"image_size": 64}},
    # the SAM tower's features are read at its first global-attention block: block 0 of the one built
    "deepseek_vl_hybrid": {
        "vision_config": {"image_size": 64},
        "high_res_vision_config": {"image_size": 64, "global_attn_indexes": [0]},
    },
    # Ernie splits its rotary into height-width and time sections: 4 and 4 of head_dim 16's 8 frequencies
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 2, 4]}}},
    "git": {"vision_config": {"image_size": 32, "patch_size": 16}},
    "glm46v": MROPE,
    "glm4v": MROPE,
    # GLM-4.5V rotates half of head_dim (partial_rotary_factor 0.5): 4 frequencies
    "glm4v_moe": {
        "text_config": {
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}
        }
    },
    "glm_ocr": MROPE,
    "glmga": MROPE,
    "got_ocr2": {"vision_config": {"image_size": 256}},
    # the aligner projects the tower's features to the text model's width
    # (and a small VQ model: it generates images, which a prompt with an image does not run)
    "janus": {
        "vision_config": {"image_size": 64, "projection_dim": 64},
        "vq_config": {
            "num_embeddings": 64,
            "latent_channels": 32,
            "base_channels": 32,
            "channel_multiplier": [1, 2],
            "num_res_blocks": 1,
            "image_token_embed_dim": 32,
        },
    },
    "llava_next_video": {"vision_config": {"image_size": 64, "patch_size": 16}, "image_grid_pinpoints": [[64, 64]]},
    "ovis2": {"vision_config": {"image_size": 56}},
    "ovis2_5": {"image_start_token_id": START, "image_end_token_id": END},
    "paddleocr_vl": MROPE,
    "pp_chart2table": {"vision_config": {"image_size": 256}},
    "qianfan_ocr": {"vision_config": {"image_size": 56}},
    # the thinker's M-RoPE reads vision_start_token_id, which its config class does not define
    "qwen2_5_omni_thinker": {**MROPE, "vision_start_token_id": START},
    "video_llava": {"vision_config": {"image_size": 64, "patch_size": 16}},
}
#: The types whose image is a grid of flattened patches with `image_grid_thw` (Qwen2-VL's layout): 4 x 4 patches,
#: merged 2 x 2 into 4 tokens.
GRID_THW = (
    "cosmos3_edge", "ernie4_5_vl_moe", "glm46v", "glm4v", "glm4v_moe", "glm_ocr", "glmga", "llava_onevision1_5",
    "ovis2_5", "paddleocr_vl", "qwen2_5_omni_thinker", "qwen4_exp", "video_llama_3",
)  # fmt: skip


def tiny(model_type: str):
    """The tiny image-text-to-text model of `model_type`: the survey's sizes, `CONFIG`'s, the image token at `IMAGE`;
    eager, seeded, its norms perturbed as `attnlens.models` does."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tools.survey.build import _merge, tiny_kwargs

    kwargs = tiny_kwargs(model_type)
    default = CONFIG_MAPPING[model_type]()
    for name in ("image_token_id", "image_token_index"):
        if hasattr(default, name):
            kwargs[name] = IMAGE
    config = CONFIG_MAPPING[model_type](**_merge(kwargs, CONFIG.get(model_type, {})))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return _perturbed(getattr(transformers, image_text_types()[model_type])(config).eval())


def _side(size) -> int:
    return size[0] if isinstance(size, (tuple, list)) else size


def image_inputs(model_type: str, model) -> dict:
    """One image as `model`'s forward takes it: random pixels of the shape its vision config expects, and the inputs
    that size them."""
    config = model.config
    vision = getattr(config, "vision_config", None)
    random = torch.Generator().manual_seed(0)

    def pixels(*shape):
        return torch.randn(*shape, generator=random)

    if model_type in GRID_THW:  # flattened patches [patches, channels * time * patch * patch], a 1 x 4 x 4 grid
        patch, time = vision.patch_size, getattr(vision, "temporal_patch_size", 1) or 1
        channels = getattr(vision, "num_channels", getattr(vision, "in_channels", 3))
        found = {
            "pixel_values": pixels(16, channels * time * patch * patch),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
        }
        if model_type == "paddleocr_vl":  # each patch as an image [patches, channels, patch, patch]
            found["pixel_values"] = pixels(16, channels, patch, patch)
        if model_type == "video_llama_3":  # each image's merge size
            found["image_merge_sizes"] = torch.tensor([2])
        return found
    if model_type == "fuyu":  # no tower: 4 patches [batch, patches, patch * patch * channels], projected linearly
        return {"pixel_values": pixels(1, 4, config.patch_size**2 * config.num_channels)}
    if model_type == "lfm2_vl":  # SigLIP2: 16 flattened patches of a 4 x 4 grid, all real
        patch = vision.patch_size
        return {
            "pixel_values": pixels(1, 16, 3 * patch * patch),
            "spatial_shapes": torch.tensor([[4, 4]]),
            "pixel_attention_mask": torch.ones(1, 16, dtype=torch.bool),
        }
    if model_type == "apertus1p5":  # an 8 x 8 image and its true size
        return {"pixel_values": pixels(1, 3, 8, 8), "image_sizes": torch.tensor([[8, 8]])}
    side = _side(vision.image_size)
    if model_type == "idefics2":  # [batch, images, channels, side, side], all real
        return {
            "pixel_values": pixels(1, 1, 3, side, side),
            "pixel_attention_mask": torch.ones(1, 1, side, side, dtype=torch.bool),
        }
    if model_type == "llava_next_video":  # the base image and one tile of the 64 x 64 pinpoint
        return {"pixel_values": pixels(1, 2, 3, side, side), "image_sizes": torch.tensor([[side, side]])}
    if model_type == "video_llava":  # images and videos come apart
        return {"pixel_values_images": pixels(1, 3, side, side)}
    found = {"pixel_values": pixels(1, 3, side, side)}
    if model_type == "aria":
        found["pixel_mask"] = torch.ones(1, side, side, dtype=torch.bool)
    if model_type == "qianfan_ocr":
        found["image_sizes"] = torch.tensor([[side, side]])
    if model_type == "deepseek_vl_hybrid":  # the SAM tower's image beside SigLIP's
        high = _side(config.high_res_vision_config.image_size)
        found["high_res_pixel_values"] = pixels(1, 3, high, high)
    return found


def image_tokens(model, inputs: dict) -> int:
    """How many image tokens the prompt needs: the rows of the model's own `get_image_features` output."""
    features = getattr(model.model, "get_image_features", None) or model.get_image_features
    taken = inspect.signature(features).parameters
    given = dict(inputs)
    if "pixel_values_images" not in taken and "pixel_values_images" in given:  # Video-LLaVA's images, 5.25's spelling
        given["pixel_values"] = given.pop("pixel_values_images")
    with torch.no_grad():
        out = features(**{k: v for k, v in given.items() if k in taken})
    pooled = getattr(out, "pooler_output", None)
    out = pooled if pooled is not None else getattr(out, "last_hidden_state", out)
    parts = [out] if isinstance(out, torch.Tensor) else list(out)
    return sum(part.shape[:-1].numel() for part in parts)


def image_prompt(model_type: str, model) -> tuple[torch.Tensor, dict]:
    """input_ids with text around one image's tokens, and the model's inputs for the image."""
    inputs = image_inputs(model_type, model)
    if model_type == "git":  # GIT prepends the image's tokens itself: the ids are text
        return torch.tensor([[1, 40, 41, 42]]), inputs
    image = [IMAGE] * image_tokens(model, inputs)
    if model_type == "ovis2_5":  # each image between its boundary tokens, which the model counts
        image = [START, *image, END]
    if model_type == "qwen2_5_omni_thinker":  # its M-RoPE finds an image after vision_start_token_id
        image = [START, *image]
    ids = torch.tensor([[1, 40, *image, 41, 42]])
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # 1 at an image's tokens
        inputs["mm_token_type_ids"] = (ids == IMAGE).long()
    return ids, inputs


def _served(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the inferred family's advice
        return StandardizedTransformer(model, tokenizer=char_tokenizer())


def _present(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")


def compare(served, ids, inputs) -> dict:
    """Every served value of `served` on the prompt, against transformers' own run of the model (eager, with
    `output_attentions`): the patterns, hidden states, final norm and logits equal, and the identities that fail per
    block (none where the family describes the model)."""
    model = served._module
    with torch.no_grad():
        own = model(input_ids=ids, **inputs, output_attentions=True, output_hidden_states=True)
    saved = read_everything(served, ids, **inputs)
    layers = range(served.num_layers)
    patterns = [saved[(i, "attention_probabilities")] for i in layers if (i, "attention_probabilities") in saved]
    expected = [pattern for pattern in own.attentions if pattern is not None]  # a hybrid's other mixers: None
    assert len(patterns) == len(expected) > 0
    assert all(torch.equal(found, pattern) for found, pattern in zip(patterns, expected))
    hidden = [saved[(i, "layer_input")] for i in layers]
    assert len(own.hidden_states) == len(hidden) + 1
    for i, found in enumerate(hidden):  # (Qwen4-Exp's: its hyper-connection streams, the flat state as a view)
        assert torch.equal(found.reshape(own.hidden_states[i].shape), own.hidden_states[i]), i
    assert torch.equal(saved["final_norm_output"], own.hidden_states[-1])
    assert torch.equal(saved["logits"], own.logits)
    return {i: found for i in layers if (found := failures(served, saved, i))}


@pytest.mark.parametrize("model_type", [t for t in TYPES if t not in NOT_RUN and t not in REFUSED])
def test_every_served_value_on_a_prompt_with_an_image_equals_transformers_own_attention(model_type):
    """Every block's pattern torch.equal to `output_attentions` on a prompt with an image, its input the model's
    hidden state, the final norm's output and the logits equal, every identity holding (the image tokens' rows
    causal, as the family's mask says)."""
    _present(model_type)
    model = tiny(model_type)
    ids, inputs = image_prompt(model_type, model)
    assert (ids == IMAGE).sum() > 0 or model_type == "git"
    served = _served(model)
    assert compare(served, ids, inputs) == {}


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_a_family_whose_model_differs_with_images_refuses_them_with_the_measured_reason(model_type, monkeypatch):
    """Refused on a prompt with images: every block's value raises `Unavailable` with the family's reason (text
    prompts stay served, and `support()` says so); with the refusal lifted, the identities fail (the measurement
    the reason states), so the refusal hides no value that was right."""
    _present(model_type)
    model = tiny(model_type)
    ids, inputs = image_prompt(model_type, model)
    served = _served(model)
    reason = type(served.family).refuses_images
    assert reason.startswith(REFUSED[model_type])
    assert f"refused on a prompt with images: {reason}" in served.support().notes["self_attn.attention_probabilities"]
    with pytest.raises(Unavailable, match="on a prompt with images: " + REFUSED[model_type]):
        with torch.no_grad(), served.trace(ids, **inputs):
            served.layers[0].self_attn.attention_probabilities.save()
    with torch.no_grad(), served.trace(ids):  # text alone: served
        text = served.layers[0].self_attn.attention_probabilities.save()
    assert text.shape[-1] == ids.shape[1]
    monkeypatch.setattr(type(served.family), "refuses_images", None)
    if model_type == "git":  # the image's tokens are not in input_ids: the cache holds more positions than it
        with pytest.raises(Unavailable, match="holds 0 positions, but the sequence had -5 before this step"):
            compare(served, ids, inputs)
        with torch.no_grad(), served.trace(ids, **inputs):
            pattern = served.layers[0].self_attn.attention_probabilities.save()
        assert (pattern[0, :, :4, 1:5] > 0).all()  # the image's 5 tokens (class and 4 patches) see each other
        return
    found = compare(served, ids, inputs)
    assert found and all("masked entries exactly zero" in str(said) for said in found.values())


@pytest.mark.parametrize("model_type", list(NOT_RUN))
def test_a_type_not_traced_with_an_image_here_has_its_reason(model_type):
    """dots.3 Note's composite has no family (its family serves the text model AutoModelForCausalLM loads): loading
    it fails."""
    _present(model_type)
    with pytest.raises(AttributeError):
        _served(tiny(model_type))


def test_the_counts():
    """Every type of the "text" lists is here, once: equal, refused or not run (the types served with images are held
    to transformers by their own tests, tests/test_vlm_*.py)."""
    from test_vlm_breadth import TEXT_BY_FAMILY, TEXT_INFERRED

    assert sorted(TYPES) == sorted(TEXT_BY_FAMILY + TEXT_INFERRED)
    equal = [t for t in TYPES if t not in REFUSED and t not in NOT_RUN]
    print(
        f"{len(TYPES)} types served on text prompts, with an image: {len(TYPES) - len(NOT_RUN)} built and traced, "
        f"{len(equal)} equal to transformers with the identities holding, {len(REFUSED)} refused with the measured "
        f"reason ({', '.join(REFUSED)}), {len(NOT_RUN)} not traced with an image ({', '.join(NOT_RUN)})"
    )


def test_a_window_in_a_composites_text_config_applies_over_the_image_tokens():
    """Idefics2's language model (Mistral, the survey's sliding_window 4, in the text config: the composite config
    has none) on the image prompt: each row sees its last 4 positions, image tokens as text, and the family's score
    function (Idefics2's, through LanguageModelOf) masks so (it reads the window from the text config; from the
    composite's it would see no window, and the load-time check would refuse the family)."""
    model = tiny("idefics2")
    ids, inputs = image_prompt("idefics2", model)
    assert getattr(model.config, "sliding_window", None) is None and model.config.text_config.sliding_window == 4
    served = _served(model)
    with torch.no_grad(), served.trace(ids, **inputs):
        pattern = served.layers[0].self_attn.attention_probabilities.save()
    length = ids.shape[1]
    assert (pattern[0] > 0).sum(-1).tolist() == [[min(row + 1, 4) for row in range(length)]] * pattern.shape[1]
    mask = served.family.score_function().mask(length, length, model.config, 0)
    assert ((mask == 0).reshape(length, length) == (pattern[0, 0] > 0)).all()
