"""GPT-Neo: its own attention arithmetic in `GPTNeoSelfAttention._attn`, unscaled scores, alternating local layers.

The block's `attn` wraps the real attention module, `attn.attention`, which computes `_attn(query, key, value, mask)`
itself: no 1/sqrt(d) scaling (scale 1), scores upcast to float32, then `torch.where(bias, scores, finfo.min)` with
the layer's causal buffer (for `local` layers of `config.attention_types`, a window of `config.window_size` keys),
then `+ attention_mask` (causal and padding: 0 or the model dtype's minimum). A future key is masked twice, so in a
float32 model its score is `finfo.min + finfo.min = -inf`; a past key outside a local window holds finfo.min.
`_attn` returns the mix as [batch, heads, seq, head_dim], which the head outputs view as [batch, seq, heads,
head_dim] (a true view: in-place edits land).
"""

import torch

from ..family import Family, Tiny, VLLMLayout, after_attention
from ..locations import Derived, ModuleInput, ModuleOutput, Operation
from ..parts import scoring
from ..parts.sizes import Sizes

ATTN = "self__attn_0"
OWN_ARITHMETIC = (
    "attention_queries",
    "attention_keys",
    "attention_values",
    "attention_scores",
    "attention_probabilities",
    "attention_head_outputs",
)


def _heads_view(envoy, mix):
    return mix.transpose(1, 2)


def _heads_unview(envoy, mix, heads):
    return heads.transpose(1, 2)


class GPTNeo(Family):
    model_types = ("gpt_neo",)
    vllm = VLLMLayout(
        refusal="vLLM does not run GPT-Neo: \"Model architectures ['GPTNeoForCausalLM'] are not supported for "
        'now" (vLLM 0.32): it has no implementation of its own, and its Transformers backend cannot run '
        "it, because GPTNeoSelfAttention computes attention in its own _attn instead of calling "
        "transformers' attention interface",
    )
    tiny = Tiny(
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        {"attention_types": [[["global", "local"], 1], [["global"], 1]], "window_size": 4, "num_key_value_heads": None},
    )
    layers = "transformer.h"
    embed_tokens = "transformer.wte"
    final_norm = "transformer.ln_f"
    attention = "attn.attention"
    attention_norm = "ln_1"
    mlp_norm = "ln_2"
    output_projection = "out_proj"
    activation = "act"
    down_projection = "c_proj"
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_heads",), scale=(1.0,))

    def locations(self):
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_norm_output": ModuleOutput(self.attention_norm),
            "attention_queries": Operation((ATTN,), "arg", 0, anchor="self._attn("),
            "attention_keys": Operation((ATTN,), "arg", 1, anchor="self._attn("),
            "attention_values": Operation((ATTN,), "arg", 2, anchor="self._attn("),
            "attention_scores": Operation((ATTN, "attn_weights_2"), anchor="+ attention_mask"),
            "attention_probabilities": Operation((ATTN, "attn_weights_5"), anchor="self.attn_dropout("),
            "attention_head_outputs": Derived(
                Operation((ATTN,), "output", 0, anchor="self._attn("),
                _heads_view,
                _heads_unview,
                "attention_head_outputs",
            ),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput("", 0),
            **after_attention(self),
        }

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        implementation = config._attn_implementation
        if implementation != "eager":
            for name in OWN_ARITHMETIC:
                reasons[name] = (
                    f"read in GPTNeoSelfAttention._attn, which the {implementation!r} attention never "
                    f"calls; load with attn_implementation='eager'"
                )
        return reasons

    def verify(self, model, layer, layer_module, attention_module):
        if model.config._attn_implementation == "eager":  # the flash class has no `_attn` to check
            super().verify(model, layer, layer_module, attention_module)

    def drilled_functions(self, attention_module):
        return {ATTN: type(attention_module)._attn}

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return config.window_size if config.attention_layers[layer] == "local" else None

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            # `_attn`: a float32 matmul, the layer's causal (or local) buffer through torch.where, then the model's
            # additive mask (causal and padding only, in the model's dtype).
            scores = torch.matmul(queries.to(torch.float32), keys.to(torch.float32).transpose(-1, -2))
            num_queries, num_keys = scores.shape[-2:]
            key_positions = torch.arange(num_keys, device=scores.device)[None, :]
            back = key_positions.T[num_keys - num_queries :] - key_positions  # how far back each key is
            window = self.sliding_window(config, layer)
            in_buffer = (back >= 0) & (back < (window or num_keys))
            scores = torch.where(in_buffer, scores, torch.finfo(scores.dtype).min)
            visible = (back >= 0)[None, None]
            if key_mask is not None:
                visible = visible & key_mask[:, None, None, :].bool().to(visible.device)
            zero = torch.zeros((), dtype=queries.dtype, device=scores.device)
            return scores + torch.where(visible, zero, torch.finfo(queries.dtype).min)

    kind_notes = {
        "*": {
            "embeddings": "the token embedding's output; block 0's input also holds the position embeddings",
            "attention_scores": lambda family, config, layer: (
                f"unscaled (scale 1), float32; {family.local_keys(config, layer)}future keys, masked by the layer's "
                "buffer and again by the causal mask, hold float32's minimum plus the model dtype's: -inf in a "
                "float32 model"
            ),
            "attention_head_outputs": "a transposed view of what `_attn` returns (batch, heads, seq, head_dim): "
            "in-place edits land",
        }
    }

    def local_keys(self, config, layer) -> str:
        """What the scores' note says of a local layer's window ("" on a global layer)."""
        window = self.score_function().sliding_window(config, layer)
        return f"a local layer: keys more than {window - 1} back hold finfo.min; " if window else ""
