"""The causal LM transformers builds for a multimodal model type: its text model's blocks under
`model.language_model`, and its facts in the text config.

`AutoModelForCausalLM` maps some multimodal types (Gemma 3's "gemma3", Gemma 4's "gemma4") to their
`...ForConditionalGeneration` class: a vision (and audio) tower beside the language model, whose blocks are
`model.language_model.layers`. The model's config is the composite one; the layer types, windows and sizes a family
reads live in its `text_config`. `LanguageModelOf` moves the paths and hands the family's config-reading methods the
text config, so a text family serves the composite model unchanged. On text-only prompts the language model runs as
the text model does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from . import scoring

#: Where vLLM's multimodal classes hold the text model's blocks: its own text class, built as `language_model`.
VLLM_LANGUAGE_MODEL = {
    "layers": "language_model.model.layers",
    "embed_tokens": "language_model.model.embed_tokens",
    "final_norm": "language_model.model.norm",
}


def released_vllm(text: Any, model_type: str, tiny: Any, names: dict[str, str] = VLLM_LANGUAGE_MODEL) -> Any:
    """The vLLM layout of a released multimodal type whose language model is the text family `text`'s: vLLM's
    multimodal class, the text class as `language_model` (`names`), checked for `model_type`; the tiny checkpoint's
    (`tiny`) text config takes the text family's vLLM overrides."""
    overrides = {"text_config": {**tiny.kwargs["text_config"], **text.vllm.tiny}}
    return replace(text.vllm, model_types=(model_type,), names=names, tiny=overrides)


def _text(config):
    return config.get_text_config() if config is not None else None


class LanguageModelOf:
    """Mixin, before a text family: the same family, on the language model inside a multimodal causal LM."""

    layers = "model.language_model.layers"
    embed_tokens = "model.language_model.embed_tokens"
    final_norm = "model.language_model.norm"
    #: vLLM runs these types as its own multimodal classes (gemma3_mm, gemma4_mm, ...), which build the text model's
    #: own vLLM class as `language_model`: its blocks are `language_model.model.layers` (`VLLM_LANGUAGE_MODEL`; each
    #: family states the types checked there; tests_vllm runs the tiny checkpoint's language model alone,
    #: `language_model_only`).

    def layer_kind(self, config, layer):
        return super().layer_kind(_text(config), layer)

    def kind_locations(self, kind, config, engine):
        return super().kind_locations(kind, _text(config), engine)

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return super().sliding_window(_text(config), layer)

        def softcap(self, config, layer):
            return super().softcap(_text(config), layer)

        def mask(self, num_queries, num_keys, config, layer, *args, **kwargs):
            return super().mask(num_queries, num_keys, _text(config), layer, *args, **kwargs)

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            return super().scores(heads, _text(config), queries, keys, layer, key_mask)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(_text(config), layer, engine)
        media = (
            "with images (or other media) in the prompt, the model's mask may let their tokens attend to each "
            "other in both directions; the pattern read is the model's, the family's score function is causal "
            "(text)"
        )
        notes["attention_probabilities"] = "; ".join(filter(None, (notes.get("attention_probabilities"), media)))
        return notes

    def unavailable(self, config, layer, engine="transformers"):
        return super().unavailable(_text(config), layer, engine)
