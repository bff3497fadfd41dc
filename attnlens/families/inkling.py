"""Inkling (text): a decoder whose scores add a relative-position bias computed from each query's hidden state, whose
keys, values and sublayer outputs pass through causal short convolutions, and whose MLPs are mostly sparse mixtures of
experts with shared experts.

- Attention: queries are `q_norm(q_proj(x))` (RMSNorm per head), keys `k_norm(k_sconv(k_proj(x)))`, values
  `v_sconv(v_proj(x))`, where each `*_sconv` is a causal depthwise convolution over the sequence plus its input, in
  float32. The scale is `1 / head_dim` (queries and keys are RMS-normalised). Sliding layers (`layer_types`
  "hybrid_sliding") have their own head counts and size (`swa_*`) and a window of `sliding_window_size` keys; full
  layers ("hybrid") see every earlier key and, with `log_scaling_n_floor`, multiply the queries and the bias by
  `tau = 1 + log_scaling_alpha * log(max((position + 1) / log_scaling_n_floor, 1))` before the attention function.
- The scores are `queries @ keys^T / head_dim + bias + mask`: the bias (`rel_logits_proj`) mixes a learned bank of
  bias-vs-distance profiles by per-head weights `r_proj(x)`, zero `rel_extent` (on sliding layers the window) keys back
  and beyond. It comes from the hidden states, not the queries and keys, so the family's score function leaves it out
  (`score_bias`): patterns are not rebuilt under sdpa (which transformers runs without the bias) nor summarised from
  queries and keys, and the identities add the bias computed from `attention_norm_output`.
- Each sublayer's output passes through a short convolution before the residual add: `layer_mid = layer_input +
  attn_sconv(attention_output)`, `layer_output = layer_mid + mlp_sconv(mlp_output)` (the common layout's post-norms).
- MLPs: "dense" layers (`mlp_layer_types`) are a gated MLP whose output is scaled by `mlp.global_scale`; "sparse"
  layers route each token to its experts and add shared experts weighted by the router (no single activation tensor).
- The embeddings are RMS-normalised in the embedding module; the logits are `lm_head(final_norm_output /
  logits_mup_width_multiplier)`.

Inkling's multimodal model ("inkling", with vision and audio towers) is not a causal LM transformers builds through
`AutoModelForCausalLM`; only the text model is served here.
"""

from __future__ import annotations

import torch

from ..family import EagerFunction, Family, Tiny, VLLMLayout
from ..parts import identities, scoring
from ..parts.moe import PER_EXPERT, SparseMoE
from ..parts.sizes import Sizes

MOE_REASON = (
    "a sparse mixture of experts: no [batch, seq, intermediate] tensor exists. Each routed expert applies "
    "act_fn(gate) * up only to the tokens routed to it, inside mlp.experts (one expert at a time over the "
    "flattened tokens), and mlp.shared_experts forms each shared expert's activation scaled by its router "
    "weight; mlp_output is the routed experts' weighted sum plus the shared experts'"
)
BIAS = (
    "a relative-position bias computed from each query's hidden state (r_proj mixes rel_logits_proj's learned "
    "bias-vs-distance profiles per head)"
)


def log_scale(config, num_queries: int, device=None) -> torch.Tensor | None:
    """Full layers' `tau` per query position (from 0) [query], or None without log scaling."""
    if config.log_scaling_n_floor is None:
        return None
    positions = torch.arange(num_queries, device=device)
    return 1.0 + config.log_scaling_alpha * torch.log(
        ((positions + 1).float() / config.log_scaling_n_floor).clamp(min=1.0)
    )


class Inkling(SparseMoE, Family):
    model_types = ("inkling_text",)
    vllm = VLLMLayout(
        refusal="vLLM 0.32's InklingForCausalLM (vllm/models/inkling) needs Inkling's own tokenizer: with another "
        "it stops with \"Inkling tokenizer is missing special tokens: ['<|message_user|>', ...]\", so attnlens has "
        "not checked its locations there; the transformers engine serves the family",
    )
    tiny = Tiny(
        "InklingTextConfig",
        "InklingForCausalLM",
        {
            "head_dim": 16,
            "swa_num_attention_heads": 2,
            "swa_num_key_value_heads": 1,
            "swa_head_dim": 32,
            "sliding_window_size": 4,
            "d_rel": 8,
            "rel_extent": 8,
            "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
        },
        layouts={"log_scaling": {"log_scaling_n_floor": 4, "log_scaling_alpha": 0.5}},
    )
    # log scaling needs full layers past its floor: 18-token prompts pass a floor of 4
    eager = EagerFunction(scores=("attn_weights_2", "+ attention_mask"), probabilities=("attn_weights_4", "dropout("))
    attention_post_norm = "attn_sconv"
    mlp_post_norm = "mlp_sconv"
    absent = {**Family.absent, **dict.fromkeys(PER_EXPERT, MOE_REASON)}
    padding_changes_values = (
        "with log_scaling_n_floor set, full layers scale queries and the bias by each query's "
        "position counted from the padded start"
    )
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_key_value_heads",))

    def moe_layer(self, config, layer):
        return config.mlp_layer_types[layer] == "sparse"

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return config.sliding_window_size if config.layer_types[layer] == "hybrid_sliding" else None

        def score_bias(self, config, layer):
            full = config.layer_types[layer] != "hybrid_sliding"
            return BIAS + (", times the log scale tau" if full and config.log_scaling_n_floor is not None else "")

    class Identities(identities.Identities):
        def score_bias_value(self, module, values, layer):
            hidden = values["attention_norm_output"]
            batch, length, _ = hidden.shape
            positions = torch.arange(length, device=hidden.device)
            relative = module.r_proj(hidden).view(batch, length, module.num_heads, -1)
            bias = module.rel_logits_proj(relative, positions, positions)
            tau = None if module.is_sliding else log_scale(module.config, length, hidden.device)
            if tau is not None:
                bias = (bias.float() * tau.view(1, 1, -1, 1)).to(bias.dtype)
            return bias

    kind_reasons = {"moe": dict.fromkeys(PER_EXPERT, MOE_REASON)}

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        sliding = config.layer_types[layer] == "hybrid_sliding"
        extent = config.sliding_window_size if sliding else config.rel_extent
        tau = not sliding and config.log_scaling_n_floor is not None
        scale = (
            f"; times tau = 1 + {config.log_scaling_alpha} * log(max((position + 1) / "
            f"{config.log_scaling_n_floor}, 1)), the query's log scale"
            if tau
            else ""
        )
        conv = "a causal depthwise short convolution over the sequence plus its input, in float32"
        notes.update(
            {
                "embeddings": "the embedding rows RMS-normalised by the embedding module (embed_tokens.embed_norm)",
                "attention_queries": f"q_norm(q_proj(x)) (RMSNorm per head){scale}",
                "attention_keys": f"k_norm(k_sconv(k_proj(x))): k_sconv is {conv}; k_norm an RMSNorm per head",
                "attention_values": f"v_sconv(v_proj(x)): v_sconv is {conv}",
                "attention_scores": (
                    f"queries @ keys^T / head_dim (queries and keys are RMS-normalised), plus {BIAS}, "
                    f"zero {extent} keys back and beyond"
                    + (", scaled by tau" if tau else "")
                    + ", then masked; the family's score function leaves the bias out"
                ),
                "attention_output": f"self_attn's output (o_proj), before attn_sconv ({conv})",
                "layer_mid": "layer_input + attn_sconv(attention_output): a short convolution follows attention",
                "layer_output": "layer_mid + mlp_sconv(mlp_output): a short convolution follows the MLP",
                "logits": "lm_head(final_norm_output / logits_mup_width_multiplier), cut to unpadded_vocab_size where "
                "set",
            }
        )
        if not self.moe_layer(config, layer):
            notes["mlp_output"] = "down_proj(mlp_neurons) * mlp.global_scale, a learned scalar"
        return notes
