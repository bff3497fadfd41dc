"""GPT-BigCode (SantaCoder, StarCoder 1): GPT-2's module names, with multi-query attention by default.

With `multi_query=True` one fused `c_attn` output is split into [queries (all heads) | one key head | one value head]:
`attention_keys` and `attention_values` have a single head ([batch, 1, seq, head_dim]), which the eager function
repeats over the query heads. With `multi_query=False` the split is per head ([q|k|v] for each head in turn) and
every head has its own keys and values. Either way the queries are a view of a view of that split, which torch
refuses to edit in place (assign them instead); the keys and values edit in place. With `scale_attn_weights=False`
the scores are not scaled at all.
"""

from dataclasses import replace

from ..family import Family, Tiny
from ..parts.fused import FusedQKV
from ..parts.mirrored import transformers_backend
from .gpt2 import GPT2


class GPTBigCode(GPT2):
    model_types = ("gpt_bigcode",)
    vllm = transformers_backend(("gpt_bigcode",), tiny={"n_embd": 128})  # head size 32
    tiny = Tiny(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        {**GPT2.tiny[2], "multi_query": True},
        layouts={"multi_head": {"multi_query": False}},
    )
    eager = Family.eager  # GPT-2's own eager function is not BigCode's
    fused_qkv = FusedQKV("c_attn", "groups")  # multi-query: one group of all heads
    sizes = replace(GPT2.sizes, num_kv_heads=("kv_heads",))

    kind_notes = {
        "*": dict.fromkeys(
            ("attention_keys", "attention_values"),
            lambda family, config, layer: (
                "multi-query: one head shared by every query head (repeated inside the eager function)"
                if config.multi_query
                else None
            ),
        )
    }
