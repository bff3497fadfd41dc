"""OLMo: the Llama layout with weightless LayerNorms and an optional `clip_qkv` that clamps the projections in place.

With `config.clip_qkv` set, the attention forward clamps the q/k/v projections' outputs in place
(`clamp_(-clip, clip)`) before the head split and the rotary embedding, so the queries, keys and values read at the
attention function are already clipped (queries and keys then rotated); an edit there is not clipped again.
"""

from ..family import Tiny
from ..parts.mirrored import transformers_backend
from .llama import Llama


class Olmo(Llama):
    model_types = ("olmo",)
    vllm = transformers_backend(("olmo",), fused_activation=True)
    # A clip that binds: with these weights the projections reach well past 1.
    tiny = Tiny("OlmoConfig", "OlmoForCausalLM", {"clip_qkv": 1.0}, layouts={"noclip": {"clip_qkv": None}})

    kind_notes = {
        "*": {
            name: (
                lambda family, config, layer, after=after: (
                    None
                    if (clip := getattr(config, "clip_qkv", None)) is None
                    else f"clamped in place to [-{clip}, {clip}] by the projection{after}; "
                    "edits here are not clamped again"
                )
            )
            for name, after in (
                ("attention_queries", " and rotated"),
                ("attention_keys", " and rotated"),
                ("attention_values", ""),
            )
        }
    }
