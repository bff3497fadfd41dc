"""XGLM: BioGPT's block (BART-style names, an MLP the block runs itself) with its own attention arithmetic on heads
folded into the batch, pre-scaled queries and sinusoidal positions.

`XGLMAttention` multiplies `q_proj`'s output by `head_dim ** -0.5` and folds the heads into the batch,
`[batch * heads, seq, head_dim]`, before `torch.bmm`; the scores are `q @ k^T + mask`, clamped below at the dtype's
minimum. The queries, keys, values, scores and pattern are views of those folded tensors as `[batch, heads, ...]`
(in-place edits land; assignments are folded back), the head outputs the forward's own transpose. The scores are read
inside the forward's `if attention_mask is not None` branch, which eager attention always takes (transformers builds
the causal mask for it).
"""

from dataclasses import replace

import torch

from ..family import Tiny, VLLMLayout
from ..locations import Operation
from ..locations.views import batch_folded
from ..parts import scoring
from ..parts.vllm import own_attention
from .biogpt import BioGpt


def folded(name, anchor, label):
    """The operation `name`'s `[batch * heads, ...]` tensor as `[batch, heads, ...]` (a view)."""
    return batch_folded(Operation((name,), anchor=anchor), label)


class XGLM(BioGpt):
    model_types = ("xglm",)
    vllm = VLLMLayout(refusal=own_attention("XGLM", "XGLMForCausalLM", "XGLMAttention"))
    tiny = Tiny(
        "XGLMConfig",
        "XGLMForCausalLM",
        {
            "num_layers": 3,
            "d_model": 64,
            "attention_heads": 4,
            "ffn_dim": 128,
            "num_hidden_layers": None,
            "hidden_size": None,
            "num_attention_heads": None,
            "num_key_value_heads": None,
            "intermediate_size": None,
        },
    )
    layers = "model.layers"
    embed_tokens = "model.embed_tokens"
    final_norm = "model.layer_norm"
    sizes = replace(BioGpt.sizes, num_heads=("num_heads",), scale=(1.0,))

    def locations(self):
        return {
            **super().locations(),
            "attention_queries": folded("query_states_2", "query_states.reshape(*proj_shape)", "queries"),
            "attention_keys": folded("key_states_3", "key_states.reshape(*proj_shape)", "keys"),
            "attention_values": folded("value_states_3", "value_states.reshape(*proj_shape)", "values"),
            "attention_scores": folded("attn_weights_3", "attn_weights.view(bsz * self.num_heads", "scores"),
            "attention_probabilities": folded("attn_probs_0", "dropout(", "probabilities"),
            "attention_head_outputs": Operation(("attn_output_2",), anchor="attn_output.transpose(1, 2)"),
        }

    class ScoreFunction(scoring.ScoreFunction):
        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            scores = torch.matmul(queries, keys.transpose(-1, -2))
            scores = scores + self.mask(
                queries.shape[2], keys.shape[2], config, layer, key_mask, scores.dtype, scores.device
            )
            return torch.clamp(scores, min=torch.finfo(scores.dtype).min)

        def sliding_window(self, config, layer):
            return None

    kind_notes = {
        "*": {
            "attention_queries": "pre-scaled: q_proj(x) * head_dim ** -0.5 (attn.scale is 1.0); a view of the "
            "heads folded into the batch",
            "attention_scores": "queries @ keys^T + mask, clamped at the dtype's minimum (the queries carry the scale)",
            "embeddings": "the scaled token embedding's output; sinusoidal positions are added before layers[0]",
        }
    }
