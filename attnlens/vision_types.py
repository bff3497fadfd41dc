"""What attnlens does with each image-text-to-text model type of transformers (`AutoModelForImageTextToText`'s
registry, `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`): `coverage(config)` states it from the type's config.

Three outcomes:

- "images": a registered family with a vision tower (`towers`) or an image layout (`images`): prompts with images are
  served; the coverage names each tower served or refused, and whether `model.positions` lays the image tokens out.
- "text": the language model is served, its images' positions not laid out (no tower mounted, `model.positions`
  refuses image prompts): by the family registered for the type (or, where `AutoModelForCausalLM` loads the
  checkpoint as its text model, for the text config's type), or by the common layout `attnlens.inferred` infers on
  the model transformers builds from the type's default config. On a prompt with images, a type of
  `CHECKED_WITH_IMAGES` has its values served and checked against transformers' own attention, or refused with the
  family's measured reason (`LanguageModelOf.refuses_images`) where the model's mask differs there; another type is
  served on text prompts (its image prompts unchecked).
- "none": no family, and the common layout is refused (the check that failed is the reason), or transformers does not
  build the model from the type's default config here (the error is the reason).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Literal

OUTCOMES = ("images", "text", "none")
#: The "text" types whose values on a prompt with an image were compared with transformers' own attention on a tiny
#: model built from the type's config classes (tests/test_vlm_breadth_images.py): served there and equal, or refused
#: where the family says why (`LanguageModelOf.refuses_images`). Another "text" type's image prompts are unchecked.
CHECKED_WITH_IMAGES = (
    "apertus1p5", "aria", "cosmos3_edge", "deepseek_vl", "deepseek_vl_hybrid", "ernie4_5_vl_moe", "fuyu",
    "git", "glm46v", "glm4v", "glm4v_moe", "glm_ocr", "glmga", "got_ocr2",
    "janus", "lfm2_vl", "llava_next_video", "llava_onevision1_5", "ovis2", "ovis2_5",
    "paddleocr_vl", "pp_chart2table", "qianfan_ocr", "qwen2_5_omni_thinker", "qwen4_exp",
    "video_llama_3", "video_llava",
)  # fmt: skip


@dataclass(frozen=True)
class Coverage:
    """What attnlens does with a model type: `outcome` (one of `OUTCOMES`), the family serving it (its class name;
    "Inferred" for the inferred common layout; None where nothing does), and what, or why not (`detail`)."""

    model_type: str
    outcome: Literal["images", "text", "none"]
    family: str | None
    detail: str

    def __str__(self) -> str:
        return f"{self.model_type}: {self.outcome} ({self.family or 'no family'}): {self.detail}"


def image_text_types() -> dict[str, str]:
    """transformers' image-text-to-text registry: model type -> the class `AutoModelForImageTextToText` builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _first_line(text: str | None) -> str:
    return " ".join((text or "").split("\n\n")[0].split())


def _with_images(model_type: str, family: type) -> Coverage:
    said = []
    for name, tower in family.towers.items():
        said.append(f"tower model.{name} served ({tower.family.__name__}, the model's {tower.path})")
    for name, why in getattr(family, "towers_refused", {}).items():
        said.append(f"tower model.{name} refused: {why}")
    if not family.towers and not getattr(family, "towers_refused", {}):
        said.append("no tower mounted")
    images = family.images
    if images is None:
        said.append("image positions not laid out (model.positions refuses image prompts)")
    elif images.refused:
        said.append(f"image positions refused: {images.refused}")
    else:
        both = "; an image's tokens attend to each other both ways" if images.bidirectional else ""
        said.append(
            f"image positions laid out by model.positions ({type(images).__name__}: "
            f"{_first_line(type(images).__doc__)}{both})"
        )
    return Coverage(model_type, "images", family.__name__, "; ".join(said))


def _built_on_meta(config: Any):
    """The image-text-to-text model of `config` as transformers builds it (the registry's class for its type), on the
    meta device (no weights, no memory), eager attention."""
    import torch
    import transformers

    name = image_text_types().get(config.model_type)
    built = getattr(transformers, name) if name else transformers.AutoModelForImageTextToText
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return built._from_config(copy.deepcopy(config), attn_implementation="eager")


def coverage(config: Any) -> Coverage:
    """What attnlens does with a model of `config` (an image-text-to-text type's config, e.g.
    `AutoConfig.for_model(model_type)`): served with images, its language model on text prompts only, or not served,
    and what or why (`Coverage`). A type without a family is built on the meta device from `config` and checked
    against the common layout (`attnlens.inferred.Inferred`), which `StandardizedTransformer` infers at load."""
    from .inferred import Inferred, NotCommonLayout
    from .parts.multimodal import LanguageModelOf
    from .registry import registered
    from .standardized import built_as_text_model

    model_type = config.model_type
    families = registered()
    text_type = config.get_text_config().model_type
    family = families.get(model_type)
    if family is not None and (getattr(family, "towers", None) or getattr(family, "images", None) is not None):
        return _with_images(model_type, family)
    no_images = "images are not laid out (no vision tower mounted; model.positions refuses image prompts)"
    unplaced = "image positions not laid out (no vision tower mounted; model.positions refuses image prompts)"

    def prompts(served: type | None) -> str:  # what follows "serves the language model"
        refused = getattr(served, "refuses_images", None)
        if refused:
            return f" on text prompts; values on image prompts refused: {refused}; {unplaced}"
        if model_type in CHECKED_WITH_IMAGES:
            return f"; values on image prompts served and checked against transformers' own attention; {unplaced}"
        return f" on text prompts; {no_images}"

    if family is not None and built_as_text_model(config) and not issubclass(family, LanguageModelOf):
        return Coverage(  # a text family that maps the composite type too (dots.3 Note's)
            model_type,
            "text",
            family.__name__,
            f"AutoModelForCausalLM loads a {model_type} checkpoint as its text model ({text_type}, the towers "
            f"dropped), which {family.__name__} serves on text prompts (not the image-text-to-text class built as an "
            f"object); {no_images}",
        )
    if family is not None:
        return Coverage(
            model_type,
            "text",
            family.__name__,
            f"{family.__name__} serves the language model{prompts(family)}",
        )
    if built_as_text_model(config) and text_type in families:
        text = families[text_type].__name__
        return Coverage(
            model_type,
            "text",
            text,
            f"AutoModelForCausalLM loads a {model_type} checkpoint as its text model ({text_type}, the towers "
            f"dropped), which {text} serves on text prompts; {no_images}",
        )
    none = f"attnlens has no family for {model_type!r}"
    if text_type in families:
        none += (
            f" (its language model's type, {text_type!r}, has one: {families[text_type].__name__}, on that text model "
            f"alone)"
        )
    try:
        model = _built_on_meta(config)
    except Exception as error:  # noqa: BLE001  (whatever transformers raises is the reason)
        return Coverage(
            model_type,
            "none",
            None,
            f"{none}; transformers does not build the model from the type's default config here "
            f"({type(error).__name__}: {_first_line(str(error))}), so the common layout could not be checked",
        )
    try:
        inferred = Inferred(model)
    except NotCommonLayout as refusal:
        return Coverage(model_type, "none", None, f"{none}, and the common layout is refused: {refusal}")
    return Coverage(
        model_type,
        "text",
        "Inferred",
        f"{none}; StandardizedTransformer infers the common layout on its language model ({inferred.layers}: every "
        f"check of attnlens.inferred passes on the model of the default config) and serves it{prompts(None)}",
    )


def coverages() -> dict[str, Coverage]:
    """`coverage` of every type of transformers' image-text-to-text registry, from its default config."""
    from transformers import AutoConfig

    found = {}
    for model_type in image_text_types():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = AutoConfig.for_model(model_type)
            except ValueError as error:  # a composite whose config wants its parts (vision-encoder-decoder)
                found[model_type] = Coverage(model_type, "none", None, f"no default config: {error}")
                continue
            found[model_type] = coverage(config)
    return found
