"""Flint: a learned sink logit per head as in GPT-OSS, per-head QK RMSNorm, rotary embedding on sliding layers only,
float32 scores, and Qwen-style mixture-of-experts MLPs with a shared expert.

The eager function computes `q @ k^T * scale` in float32 (queries and keys upcast, autocast off), adds the mask,
appends each head's sink logit as an extra key column, takes the softmax and drops that column: the pattern's rows sum
to `1 - attention_sinks`, and `attention_sinks` is the dropped column's probability. Full-attention layers have no
positional encoding. Layers `(i + 1) % decoder_sparse_step == 0` outside `mlp_only_layers` route tokens to experts
(plus the shared expert), so no activation or neuron tensor exists there.
"""

import torch

from ..family import Family, Tiny, VLLMLayout
from ..parts import scoring
from ..parts.moe import SparseMoE, moe_absent
from ..parts.sinks import SINK_NOTE, eager_with_sinks, sink_share, with_sinks
from ..parts.vllm import not_in_transformers


class Flint(SparseMoE, Family):
    model_types = ("flint",)
    vllm = VLLMLayout(refusal=not_in_transformers("Flint", "FlintForCausalLM", "FlintConfig", "flint"))
    tiny = Tiny(
        "FlintConfig",
        "FlintForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "mlp_only_layers": [0],
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        },
    )
    eager = eager_with_sinks()
    absent = {
        **moe_absent("FlintExperts", extra=", plus the shared expert's output"),
        "attention_gate": Family.absent["attention_gate"],
    }

    def moe_layer(self, config, layer):
        return (
            layer not in (config.mlp_only_layers or [])
            and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0
        )

    def locations(self):
        return with_sinks(super().locations(), sink_share("F_softmax_0"))

    class ScoreFunction(scoring.ScoreFunction):
        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            # float32 products, plus the mask in the model's dtype
            groups = queries.shape[1] // keys.shape[1]
            scores = (
                torch.matmul(queries.float(), keys.float().repeat_interleave(groups, 1).transpose(2, 3)) * heads.scale
            )
            return scores + self.mask(
                queries.shape[2], keys.shape[2], config, layer, key_mask, queries.dtype, queries.device
            )

    def notes(self, config, layer, engine="transformers"):
        rotated = (
            "then rotated"
            if config.layer_types[layer] == "sliding_attention"
            else "not rotated (full-attention layers have no positional encoding)"
        )
        notes = super().notes(config, layer, engine)
        return {
            **notes,
            "attention_sinks": SINK_NOTE,
            "attention_probabilities": (
                "rows sum to 1 - attention_sinks: the sink column is dropped after the "
                "softmax. " + notes.get("attention_probabilities", "")
            ).strip(),
            "attention_scores": "float32 whatever the model's dtype (queries and keys upcast), masked",
            "attention_queries": f"RMS-normalised per head (q_norm), {rotated}",
            "attention_keys": f"RMS-normalised per head (k_norm), {rotated}",
        }
