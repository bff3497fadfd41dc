"""GPT-NeoX-Japanese: its own attention arithmetic (`_attn`), one fused projection laid out per head, partial rotary
embedding, and a bias that the last block's attention returns separately for the block to add.

`query_key_value` is viewed as [batch, seq, heads, 3 * head_dim] and sliced into queries, keys and values per head;
queries and keys are read after the rotary embedding (over the first `partial_rotary_factor` of each head), as
`_attn` receives them (keys and values after the cache's update, so as long as the cache under generate). `_attn`
computes the scores with `baddbmm(zeros, q, k^T, alpha=1 / sqrt(head_dim))`, adds the model's additive mask, and
softmaxes: the scores are the softmax's input, the pattern what multiplies the values (after the attention dropout).
The head outputs are a transposed view of `_attn`'s [batch, heads, seq, head_dim] result. There is no grouping and no
sdpa path: the pattern is formed whatever `attn_implementation` says.

The block is sequential with two LayerNorms. The attention module returns `(dense(premix), weights, dense_bias)`;
only the last block's attention has a `dense_bias` (`use_bias=layer_number == num_hidden_layers - 1`), and the block
adds it in `bias_dropout_add` before the residual add. `attention_output` is the attention module's output,
`dense(premix)`, as elsewhere; on the last layer `layer_mid = layer_input + attention_output + dense_bias`
(`residual_add`).
"""

import torch

from ..family import EagerFunction, Family, Tiny, VLLMLayout
from ..locations import Derived, ModuleInput, ModuleOutput, Operation
from ..parts import identities, scoring
from ..parts.fused import FusedQKV
from ..parts.sizes import Sizes
from ..parts.vllm import own_attention

ATTN = "self__attn_0"  # GPTNeoXJapaneseAttention._attn, called from its forward


def _heads_last(envoy, per_head):
    return per_head.transpose(1, 2)


def _heads_first(envoy, old, new):
    return new.transpose(1, 2)


class GPTNeoXJapanese(Family):
    model_types = ("gpt_neox_japanese",)
    vllm = VLLMLayout(
        refusal=own_attention("GPT-NeoX-Japanese", "GPTNeoXJapaneseForCausalLM", "GPTNeoXJapaneseAttention")
    )
    tiny = Tiny(
        "GPTNeoXJapaneseConfig",
        "GPTNeoXJapaneseForCausalLM",
        {"num_key_value_heads": None, "intermediate_size": None, "rotary_pct": 0.25, "is_decoder": True},
    )
    layers = "gpt_neox_japanese.layers"
    embed_tokens = "gpt_neox_japanese.embed_in"
    final_norm = "gpt_neox_japanese.final_layer_norm"
    attention = "attention"
    output_projection = "dense"
    activation = "act"
    down_projection = "dense_4h_to_h"
    eager = EagerFunction(
        only=()
    )  # `_attn` is the only attention path: the pattern exists under any attn_implementation
    fused_qkv = FusedQKV("query_key_value", "groups")
    sizes = Sizes(
        num_heads=("num_attention_heads",),
        num_kv_heads=("num_attention_heads",),
        head_dim=("head_size",),
        scale=(lambda module, found: 1.0 / module.norm_factor,),
    )

    def locations(self):
        return {
            **super().locations(),
            "attention_queries": Operation((ATTN,), "arg", 0),
            "attention_keys": Operation((ATTN,), "arg", 1),
            "attention_values": Operation((ATTN,), "arg", 2),
            "attention_scores": Operation(
                (ATTN, "nn_functional_softmax_0"), "arg", 0, anchor="softmax(attention_scores"
            ),
            "attention_probabilities": Operation((ATTN, "attn_weights_2"), anchor=".to(value.dtype)"),
            "attention_head_outputs": Derived(
                Operation((ATTN,), "output", 0), _heads_last, _heads_first, "attention_head_outputs (held heads first)"
            ),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput("", 0),
        }

    def drilled_functions(self, attention_module):
        return {ATTN: type(attention_module)._attn}

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return None

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            """`_attn`'s arithmetic: `baddbmm` of zeros and q @ k^T with alpha = 1 / sqrt(head_dim), plus the mask."""
            batch, num_heads, num_queries, dim = queries.shape
            num_keys = keys.shape[2]
            flat = torch.baddbmm(
                torch.zeros(batch * num_heads, num_queries, num_keys, dtype=queries.dtype, device=queries.device),
                queries.reshape(batch * num_heads, num_queries, dim),
                keys.reshape(batch * num_heads, num_keys, dim).transpose(1, 2),
                beta=1.0,
                alpha=heads.scale,
            )
            scores = flat.view(batch, num_heads, num_queries, num_keys)
            return scores + self.mask(num_queries, num_keys, config, layer, key_mask, scores.dtype, scores.device)

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            bias = block.attention.dense_bias if sublayer == "attention" else None
            return stream + update if bias is None else stream + (update + bias)

    kind_notes = {
        "*": {
            "attention_queries": "after the rotary embedding over the first partial_rotary_factor of each head, as "
            "_attn receives them",
            "attention_scores": "q @ k^T / sqrt(head_dim) (baddbmm), plus the model's additive mask: the softmax's "
            "input",
            "attention_head_outputs": "a transposed view of _attn's (batch, heads, seq, dim) result",
            "attention_output": lambda family, config, layer: (
                "dense(premix), without the last layer's dense_bias: the attention returns that bias separately and "
                "the block adds it before the residual"
                if layer == config.num_hidden_layers - 1
                else None
            ),
            "layer_mid": lambda family, config, layer: (
                "layer_input + attention_output + attention.dense_bias (the last layer's own bias)"
                if layer == config.num_hidden_layers - 1
                else None
            ),
        }
    }
