"""Doge: the common attention plus a dynamic mask computed from the values (Dynamic Mask Attention), learned
per-channel residual weights, and optionally a CDMoE MLP.

- Queries and keys are read after q_norm / k_norm (RMSNorms) and the rotary embedding, values after v_proj.
- The mask the attention hands its function is `prepare_dynamic_mask`'s: each key/value head's `exp(A *
  softplus(dt_proj(values of every head, concatenated)))`, one number per head and key, added to every query's
  score of that key; the model's causal (or sliding-window) mask sets masked entries to the dtype's minimum; where
  there are more than `keep_window_size` keys, each query keeps only the `keep_window_size` keys of largest dynamic
  mask and the rest are masked too. So `attention_scores` (read under eager, exact) are `q @ k^T * head_dim ** -0.5 +
  that mask`. The family's score function computes it exactly, from the queries, the keys and the values
  (`ScoreFunction.scores_need_values`): the dynamic mask needs the values and the layer's `A` and `dt_proj`, which
  `attn.heads` carries. Head summaries and patterns rebuilt on sdpa read only the queries and keys, so they refuse
  Doge.
- The residual adds weigh the stream per channel: `layer_mid = input_residual * layer_input + attention_output`,
  `layer_output = post_attention_residual * layer_mid + mlp_output` (hidden dropout is off in eval).
- With `is_moe` the MLP is a CDMoE: a dense gated MLP (`gate_proj`, `up_proj`, `down_proj`) plus retrieval experts
  (`down_embed`, `up_embed`, chosen by product keys); it returns `(output, router logits)` and `mlp_output` is the
  first item. Its activation runs twice (on the experts' weights and on the dense part), and down_proj's output is
  only one part of `mlp_output`, so `mlp_activation` and `mlp_neurons` are unavailable there. Its router reshapes
  the logits of the whole batch as `view(2, batch * seq, -1)`, which pairs halves of different tokens' logits: a
  token's routing depends on other tokens of the forward (later ones, other prompts of a batch) - transformers
  keeps it for the checkpoints' sake.
"""

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from ..family import Tiny, VLLMLayout
from ..geometry import HeadGeometry
from ..locations import ModuleOutput
from ..parts import identities, scoring
from ..parts.sizes import Sizes
from ..parts.vllm import computes_otherwise
from .llama import Llama

DYNAMIC = "Doge adds a dynamic mask exp(A * softplus(dt_proj(values))) per key/value head and key"
CDMOE = (
    "a CDMoE layer (is_moe): its activation runs twice, on the retrieval experts' weights and on the dense "
    "gated part, and down_proj gives only the dense part of mlp_output, to which the experts' states are added "
    "(up_embed mixed by the activated, routing-weighted down_embed scores): no one tensor is what the "
    "catalogue names"
)


@dataclass(frozen=True)
class DogeHeads(HeadGeometry):
    """Doge's heads: the sizes, and the layer's `A` and `dt_proj`, which make the dynamic mask from the values."""

    A: Any = field(default=None, compare=False, repr=False)
    dt_proj: Any = field(default=None, compare=False, repr=False)

    def dynamic_mask(self, values: torch.Tensor) -> torch.Tensor:
        """[batch, num_kv_heads, key] from the values [batch, num_kv_heads, key, head_dim], as DogeAttention."""
        flat = values.transpose(1, 2).reshape(values.shape[0], values.shape[-2], -1)
        return torch.exp(self.A * F.softplus(self.dt_proj(flat))).transpose(-1, -2)


@dataclass(frozen=True)
class DogeSizes(Sizes):
    """Llama's sizes; the heads carry the layer's `A` and `dt_proj` too (`DogeHeads`)."""

    def geometry(self, module, family=None):
        heads = super().geometry(module, family)
        return DogeHeads(
            **{f.name: getattr(heads, f.name) for f in fields(HeadGeometry)}, A=module.A, dt_proj=module.dt_proj
        )


class Doge(Llama):
    model_types = ("doge",)
    vllm = VLLMLayout(
        refusal=computes_otherwise(
            "Doge",
            "the backend's attention function (vllm_attention_forward) drops the attention mask DogeAttention hands "
            "it, which carries Doge's dynamic mask: with the tiny checkpoint's A (initialised to 0, a constant mask) "
            "log-probabilities agree within 2.6e-6, with A drawn from N(0, 1) vLLM's greedy tokens stay the same and "
            "transformers' differ from the first (log-probabilities 0.84 apart)",
        )
    )
    # keep_window_size above the test prompt: every causal key is kept
    # (tests/families/test_doge.py makes it bind)
    tiny = Tiny("DogeConfig", "DogeForCausalLM", {"head_dim": 16})

    class ScoreFunction(scoring.ScoreFunction):
        scores_need_values = DYNAMIC

        def scores(self, heads, config, queries, keys, layer, key_mask=None, values=None):
            """DogeAttention's scores: `q @ k^T * scale` plus `prepare_dynamic_mask` of the values (needed)."""
            if values is None:
                raise ValueError(
                    f"Doge's score function needs the layer's values (values=): {DYNAMIC}, computed from them"
                )
            groups = queries.shape[1] // keys.shape[1]
            scores = torch.matmul(queries, keys.repeat_interleave(groups, dim=1).transpose(2, 3)) * heads.scale
            num_queries, num_keys = queries.shape[2], keys.shape[2]
            dtype, minimum = scores.dtype, torch.finfo(scores.dtype).min
            causal = self.mask(num_queries, num_keys, config, layer, key_mask, dtype, scores.device)
            mask = heads.dynamic_mask(values)[:, :, None, :].expand(-1, -1, num_queries, -1)
            mask = mask.masked_fill(causal != 0, minimum)
            if num_keys > config.keep_window_size:
                kept = torch.topk(mask, config.keep_window_size, dim=-1, largest=True, sorted=False).indices
                active = torch.zeros_like(mask, dtype=dtype).scatter(-1, kept, 1.0)
                mask = mask.masked_fill(active == 0.0, minimum)
            return scores + mask.repeat_interleave(groups, dim=1)

    absent = {**Llama.absent, "mlp_activation": CDMOE, "mlp_neurons": CDMOE}

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"cdmoe"} if config.is_moe else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "cdmoe" in kind:
            locations = {
                name: location for name, location in locations.items() if name not in ("mlp_activation", "mlp_neurons")
            }
            locations["mlp_output"] = ModuleOutput("", 0)
        return locations

    sizes = DogeSizes()

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            weight = block.input_residual if sublayer == "attention" else block.post_attention_residual
            return weight * stream + update

        def mlp_forward(self, mlp, mlp_input, **arguments):
            out = mlp(mlp_input)
            return out[0] if isinstance(out, tuple) else out

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        window = (
            f"; past keep_window_size={config.keep_window_size} keys, each query keeps only the "
            f"keep_window_size keys of largest dynamic mask (the rest masked)"
        )
        notes.update(
            {
                "attention_queries": "after q_norm (RMSNorm) and the rotary embedding",
                "attention_keys": "after k_norm (RMSNorm) and the rotary embedding",
                "attention_scores": f"q @ k^T * scale + the dynamic mask: exp(A * softplus(dt_proj(values))) per "
                f"key/value "
                f"head and key, the same for every query{window}; the family's score function "
                f"needs the values (scores(..., "
                f"values=))",
                "layer_mid": "input_residual * layer_input + attention_output (a learned weight per channel on the "
                "stream)",
                "layer_output": "post_attention_residual * layer_mid + mlp_output (a learned weight per channel)",
            }
        )
        if config.keep_window_size is not None:
            notes["attention_probabilities"] = "; ".join(
                filter(
                    None,
                    (
                        notes.get("attention_probabilities"),
                        f"dynamic mask: past keep_window_size={config.keep_window_size} "
                        f"keys, a query sees only the keep_window_size keys of largest "
                        f"dynamic mask",
                    ),
                )
            )
        if config.is_moe:
            notes["mlp_output"] = (
                "the CDMoE's output: down_proj(act(gate_proj(x)) * up_proj(x)) plus the retrieval "
                "experts' states; its router pairs halves of different tokens' logits (view(2, "
                "batch * seq, -1)), so a token's routing depends on the other tokens of the "
                "forward, later ones and other prompts of a batch included"
            )
        return notes
