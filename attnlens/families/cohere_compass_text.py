"""Cohere Compass's text model: Cohere's parallel block (one `input_layernorm` read by attention and the MLP, both
added to the input at once) with sliding and full layers, a rotary embedding per layer type where
`config.rope_parameters` gives one, and logits times `logit_scale`."""

from packaging.version import Version
from transformers import __version__

from ..family import Tiny, VLLMLayout
from .cohere import Cohere

#: transformers 5.19's CohereCompassRotaryEmbedding fails on any per-layer-type rope configuration.
BUILDS = Version(__version__) >= Version("5.20")


class CohereCompassText(Cohere):
    model_types = ("cohere_compass_text",)
    tiny = (
        Tiny(
            "CohereCompassTextConfig",
            "CohereCompassForCausalLM",
            {
                "head_dim": 16,
                "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                # rotary on sliding layers only: full layers without positional encoding
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": None,
                },
            },
        )
        if BUILDS
        else None
    )

    vllm = VLLMLayout(
        refusal="vLLM 0.32 does not run Cohere Compass's text model: its Transformers backend "
        "(TransformersForCausalLM) builds transformers 5.19's CohereCompassRotaryEmbedding, which fails on the "
        'per-layer-type rope configuration ("The expanded size of the tensor (16) must match the existing size '
        '(0) at non-singleton dimension 0"), and its own CohereCompassForConditionalGeneration takes the '
        'multimodal config only ("Invalid type of HuggingFace config. Expected type: <class '
        "'...CohereCompassConfig'>, but found type: <class '...CohereCompassTextConfig'>\"); the transformers "
        "engine serves the family"
    )

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        rope = (config.rope_parameters or {}).get(config.layer_types[layer])
        if rope is None:
            notes["attention_queries"] = notes["attention_keys"] = (
                "not rotated: this layer type has no rotary embedding"
            )
        return notes
