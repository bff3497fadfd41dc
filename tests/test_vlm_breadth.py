"""Every image-text-to-text type of transformers (`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`), type by type from its
default config (`AutoConfig.for_model`, nothing loaded): what attnlens does with it, as
`attnlens.vision_types.coverage` states it, against the lists below; a handful of the claims checked on tiny models
built from the config class with small sizes (the survey's sizes, `tools.survey.build.tiny_kwargs`)."""

import pathlib
import re
import warnings

import pytest
import torch
import transformers

from attnlens import StandardizedTransformer
from attnlens.errors import Unavailable
from attnlens.models import _perturbed, char_tokenizer
from attnlens.vision_types import CHECKED_WITH_IMAGES, coverages, image_text_types

#: The lists are transformers 5.25's registry: run on the newest transformers only (`make test-eager-vllm` deselects it)
pytestmark = pytest.mark.any_transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Where the docs' table of these outcomes is (its section, "Image-text-to-text types").
DOCS = ROOT / "docs" / "vision-language.md"

#: Served with images: a family with a tower or an image layout.
IMAGES = [
    "gemma3", "gemma4", "gemma4_unified", "idefics2", "idefics3", "internvl", "lighton_ocr", "llama4", "llava",
    "llava_next", "llava_onevision", "mistral3", "mllama", "paligemma", "qwen2_5_vl", "qwen2_vl", "qwen3_5",
    "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe", "smolvlm", "vipllava",
]  # fmt: skip
#: The language model served on text prompts by a registered family.
TEXT_BY_FAMILY = [
    "dots3_note", "fuyu", "git", "qwen4_exp",
]  # fmt: skip
#: ... by the common layout attnlens.inferred infers on the model of the default config.
TEXT_INFERRED = [
    "apertus1p5", "aria", "cosmos3_edge", "deepseek_vl", "deepseek_vl_hybrid", "ernie4_5_vl_moe", "glm46v", "glm4v",
    "glm4v_moe", "glm_ocr", "glmga", "got_ocr2", "janus", "lfm2_vl",
    "llava_next_video", "llava_onevision1_5", "ovis2", "ovis2_5",
    "paddleocr_vl", "pp_chart2table", "qianfan_ocr", "qwen2_5_omni_thinker",
    "video_llama_3", "video_llava",
]  # fmt: skip
#: Not served: transformers does not build the model from the type's default config here (so the common layout
#: could not be checked); every other type of the registry is not served because the common layout is refused.
NOT_BUILT = [
    "aya_vision", "chameleon", "cohere_compass", "deepseek_ocr2", "diffusion_gemma", "emu3", "fast_vlm", "gemma3n",
    "granite4_vision", "hunyuan_vl", "perception_lm",
]  # fmt: skip

#: Claims checked on a tiny model: a text prompt's patterns on every block equal `output_attentions` (types whose
#: tiny model builds from sizes alone in well under a second; the M-RoPE types' text configs need their rotary
#: sections resized with head_dim, more than sizes, and are not built here).
CHECKED_TEXT = ["fuyu", "git", "gemma4", "llama4", "mistral3", "smolvlm", "llava_onevision"]
#: ... and a type not served: its attention values raise Unavailable (no family, the common layout refused).
CHECKED_NONE = ["cohere2_vision"]


@pytest.fixture(scope="module")
def outcomes():
    return coverages()


def test_every_image_text_to_text_type_of_transformers_is_served_with_images_on_text_or_not_with_its_reason(outcomes):
    """Each type's coverage, from its config alone: the three lists are what `coverage` says, so a new family (or a
    newer transformers) changes them and the counts."""
    assert list(outcomes) == list(image_text_types())
    by = {
        outcome: sorted(t for t, c in outcomes.items() if c.outcome == outcome)
        for outcome in ("images", "text", "none")
    }
    print(
        f"{len(outcomes)} image-text-to-text types: {len(by['images'])} served with images, {len(by['text'])} their "
        f"language model on text prompts only ({len(TEXT_BY_FAMILY)} by a family, {len(TEXT_INFERRED)} by the inferred "
        f"common layout), {len(by['none'])} not served"
    )
    assert by["images"] == sorted(IMAGES)
    assert by["text"] == sorted(TEXT_BY_FAMILY + TEXT_INFERRED)
    assert sorted(t for t in by["text"] if outcomes[t].family == "Inferred") == sorted(TEXT_INFERRED)
    assert by["none"] == sorted(set(outcomes) - set(IMAGES) - set(TEXT_BY_FAMILY) - set(TEXT_INFERRED))
    for model_type, said in outcomes.items():
        assert said.model_type == model_type and said.detail
        if said.outcome == "images":
            towers = "tower model.vision" in said.detail or "no tower mounted" in said.detail  # (Gemma 4 Unified's)
            assert said.family and towers and "image positions" in said.detail
        elif said.outcome == "text":
            assert said.family and ("images are not laid out" in said.detail or "positions not laid out" in said.detail)
            checked = "values on image prompts served and checked" in said.detail
            assert checked == (model_type in CHECKED_WITH_IMAGES and model_type not in ("git", "gemma4_unified"))
        else:
            assert said.family is None and f"no family for {model_type!r}" in said.detail
            building = "does not build the model" in said.detail
            assert building == (model_type in NOT_BUILT), said
            assert building or "the common layout is refused: " in said.detail, said


def test_the_types_served_with_images_name_what_is_served_or_refused_and_have_their_family_tests(outcomes):
    """Served with images: each tower served or refused, positions laid out or refused, as the family states them;
    and the family's own tests (the every-value comparisons with images) exist."""
    assert "image positions laid out by model.positions (LlavaNextImages" in outcomes["llava_next"].detail
    mllama = outcomes["mllama"].detail
    assert "tower model.vision served (MllamaVisionTower, the model's model.vision_model.transformer)" in mllama
    assert "tower model.vision_global served (MllamaGlobalTower" in mllama and "refused" not in mllama
    assert "an image's tokens attend to each other both ways" in outcomes["gemma3"].detail
    assert "tower model.vision served (Qwen2_5VisionTower, the model's model.visual)" in outcomes["qwen2_5_vl"].detail
    suites = [p.read_text() for p in (ROOT / "tests").glob("test_v*.py") if p.name != pathlib.Path(__file__).name]
    for model_type in IMAGES:
        assert any(f'"{model_type}"' in text for text in suites), f"no family test names {model_type}"


def tiny_image_text(model_type: str):
    """A tiny model of `model_type`'s image-text-to-text class from its config class, the survey's sizes, eager."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tools.survey.build import tiny_kwargs

    config = CONFIG_MAPPING[model_type](**tiny_kwargs(model_type))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return _perturbed(getattr(transformers, image_text_types()[model_type])(config).eval())


PROMPT = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])  # characters, past pad, bos and eos


@pytest.mark.parametrize("model_type", CHECKED_TEXT)
def test_a_language_model_served_on_text_prompts_reads_transformers_own_patterns(model_type, outcomes):
    """The family `coverage` names serves the tiny model: every block's pattern on a text prompt torch.equal to
    `output_attentions` (eager; the value is read where the model computes it, so exactly equal)."""
    model = tiny_image_text(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the inferred family's advice
        served = StandardizedTransformer(model, tokenizer=char_tokenizer())
    assert type(served.family).__name__ == outcomes[model_type].family
    with torch.no_grad():
        expected = model(input_ids=PROMPT, output_attentions=True).attentions
    found = []
    with torch.no_grad(), served.trace(PROMPT):
        for layer in range(len(served.layers)):
            found.append(served.layers[layer].self_attn.attention_probabilities.save())
    assert len(found) == len(expected) > 0
    for layer, (pattern, own) in enumerate(zip(found, expected)):
        assert torch.equal(pattern, own), (model_type, layer)


@pytest.mark.parametrize("model_type", CHECKED_NONE)
def test_a_type_not_served_has_no_attention_values(model_type, outcomes):
    model = tiny_image_text(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = StandardizedTransformer(model, tokenizer=char_tokenizer())
    assert outcomes[model_type].outcome == "none"
    with pytest.raises(Unavailable, match="the common layout was refused"), torch.no_grad(), served.trace(PROMPT):
        served.layers[0].self_attn.attention_probabilities.save()


def docs_rows() -> dict[str, tuple[str, str]]:
    """The docs table's rows: type -> (outcome, family)."""
    section = DOCS.read_text().split("## Image-text-to-text types", 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \| ([^|]*) \|", section, re.M)
    return {model_type: (outcome, family.strip().strip("`")) for model_type, outcome, family in rows}


def test_the_docs_table_is_what_coverage_says(outcomes):
    expected = {t: (c.outcome, c.family or "") for t, c in outcomes.items()}
    assert docs_rows() == expected, "regenerate the table: python -m tools.vision_types"
    text = DOCS.read_text()
    by = {o: sum(c.outcome == o for c in outcomes.values()) for o in ("images", "text", "none")}
    assert f"{by['images']} served with images, {by['text']} their language model on text prompts only" in text
