"""Cohere Compass's text model: Cohere's parallel block (one `input_layernorm` read by attention and the MLP, both
added to the input at once) with sliding and full layers, a rotary embedding per layer type where
`config.rope_parameters` gives one, and logits times `logit_scale`."""

from packaging.version import Version
from transformers import __version__

from ..family import Tiny
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

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        rope = (config.rope_parameters or {}).get(config.layer_types[layer])
        if rope is None:
            notes["attention_queries"] = notes["attention_keys"] = (
                "not rotated: this layer type has no rotary embedding"
            )
        return notes
