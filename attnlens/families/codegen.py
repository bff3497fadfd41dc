"""CodeGen: GPT-J's block and attention with a fused projection interleaved over four model-parallel shards.

`qkv_proj` is viewed as [batch, seq, 4 shards, 3 * hidden / 4] and each shard split as (query, value, key), so the
fused output follows no layout `attnlens.fused` knows; the queries, keys and values are read where attention
receives them, after the partial interleaved rotary embedding. transformers 5.19 runs CodeGen's own `_attn`, which adds
the mask *before* dividing by `sqrt(head_dim)` (masked scores are `(s + min) / sqrt(d)`); later versions call the
shared attention interface (scale, then mask), as GPT-J does.
"""

import torch

from ..family import Tiny, VLLMLayout
from ..parts import scoring
from ..parts.vllm import own_attention
from .gptj import GPTJ


class CodeGen(GPTJ):
    model_types = ("codegen",)
    tiny = Tiny(
        "CodeGenConfig",
        "CodeGenForCausalLM",
        {**GPTJ.tiny[2], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None},
    )
    attention_class = ("codegen.modeling_codegen", "CodeGenAttention")
    own_scores = ("attn_weights_2", "/ self.scale_attn")
    vllm = VLLMLayout(refusal=own_attention("CodeGen", "CodeGenForCausalLM", "CodeGenAttention._attn"))

    class ScoreFunction(scoring.ScoreFunction):
        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            if not self.family.own_attn():
                return super().scores(heads, config, queries, keys, layer, key_mask)
            scores = torch.matmul(queries.float(), keys.float().transpose(2, 3))
            mask = self.mask(queries.shape[2], keys.shape[2], config, layer, key_mask, queries.dtype, queries.device)
            return (scores + mask) * heads.scale

    kind_notes = {
        "*": {
            "attention_scores": lambda family, config, layer: (
                "float32: (q @ k^T + mask) / sqrt(head_dim), the mask added before the scale, so masked entries are "
                "(score + the model dtype's minimum) / sqrt(head_dim)"
                if family.own_attn()
                else None
            ),
        }
    }
