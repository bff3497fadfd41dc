"""Persimmon: one fused `query_key_value` projection laid out per head ([q|k|v] for each head in turn), per-head QK
LayerNorm, partial rotary embedding, and a `dense` output projection.

The fused projection is viewed as [batch, seq, heads, 3, head_dim] and split into queries, keys and values; with
`qk_layernorm` (the default) a LayerNorm over each head's queries and keys runs next, then the rotary embedding over
the first `partial_rotary_factor` of each head. The queries and keys are read where the attention function receives
them, after both. Every head has its own key and value (no grouping).
"""

from ..family import Family, Tiny
from ..parts.fused import FusedQKV
from ..parts.mirrored import transformers_backend
from ..parts.sizes import Sizes, same_as


class Persimmon(Family):
    model_types = ("persimmon",)
    # vLLM dropped its own Persimmon after 0.25; its Transformers backend runs it (tests_vllm), head size 32
    vllm = transformers_backend(("persimmon",), tiny={"hidden_size": 128})
    tiny = Tiny(
        "PersimmonConfig",
        "PersimmonForCausalLM",
        {"num_key_value_heads": None},
        layouts={"no_qk_layernorm": {"qk_layernorm": False}},
    )
    final_norm = "model.final_layernorm"
    output_projection = "dense"
    activation = "act"
    down_projection = "dense_4h_to_h"
    fused_qkv = FusedQKV("query_key_value", "groups")
    sizes = Sizes(num_kv_heads=(same_as("num_heads"),))

    kind_notes = {
        "*": {
            "attention_queries": lambda family, config, layer: family.rotary_note(config.get_text_config(), "q_"),
            "attention_keys": lambda family, config, layer: family.rotary_note(config.get_text_config(), "k_", ""),
        }
    }

    def rotary_note(self, text, norm: str, of: str = " of each head") -> str:
        normed = f"LayerNorm over each head ({norm}layernorm), then " if text.qk_layernorm else ""
        rotary = int(self.rotary_fraction(text) * text.hidden_size // text.num_attention_heads)
        return f"{normed}a rotary embedding on the first {rotary} dims{of}"

    @staticmethod
    def rotary_fraction(text) -> float:
        # transformers 5.24 keeps the factor in rope_parameters; 5.19 also as an attribute
        return (getattr(text, "rope_parameters", None) or {}).get("partial_rotary_factor") or getattr(
            text, "partial_rotary_factor", 1.0
        )
