"""MPT: ALiBi added after scaling, a boolean mask applied with masked_fill, and an MLP that adds the residual itself.

`MptAttention` splits the fused `Wqkv` (clamped to +-`clip_qkv` first where the config sets it) into queries, keys
and values, then computes `matmul(q, k^T) * softmax_scale + position_bias`, masked with
`masked_fill(mask, finfo.min)` (masked entries are exactly the minimum), and the softmax on `.float()`. The position
bias is `slope_h * (key - last key)`: MPT's own slopes (`2^(-8 * i / n)` over the next power of two, odd ones first
where the head count is not one), always with `alibi_bias_max = 8` (MptModel passes no other), whatever
`attn_config.alibi` and `attn_config.alibi_bias_max` say.

Queries and keys are read as `matmul`'s arguments (keys transposed back: a true view, so in-place edits land) and
values as the second matmul's, so under generate they are the whole cache. The queries are a view of the `Wqkv`
chunk, so torch refuses in-place edits of them under autograd. `MptMLP` adds the residual it is given: `mlp_output`
is its down projection's output.
"""

import math

import torch

from ..family import Family, Joined, Tiny, VLLMLayout, after_attention
from ..locations import Derived, ModuleInput, ModuleOutput, Operation
from ..parts import identities, scoring
from ..parts.fused import FusedQKV
from ..parts.sizes import Sizes

ALIBI_BIAS_MAX = 8  # MptModel.forward calls build_mpt_alibi_tensor without the config's value


def alibi_slopes(num_heads: int, alibi_bias_max: int = ALIBI_BIAS_MAX, device=None) -> torch.Tensor:
    """MPT's per-head ALiBi slopes, float32 (as `build_mpt_alibi_tensor` orders them for any head count)."""
    power = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, power + 1, dtype=torch.int64, device=device).float() * (alibi_bias_max / power)
    slopes = 1.0 / torch.pow(2, base)
    if power != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def _transposed(envoy, keys_transposed):
    return keys_transposed.transpose(-1, -2)


def _untransposed(envoy, old, new):
    return new.transpose(-1, -2)


class MPT(Family):
    model_types = ("mpt",)
    vllm = VLLMLayout(
        refusal='vLLM does not run MPT: "Model architecture MptForCausalLM was supported in vLLM until v0.28.0, '
        'and is not supported anymore" (vLLM 0.32), and its Transformers backend cannot run it either: '
        "MptAttention computes attention itself instead of calling transformers' attention interface",
    )
    tiny = Tiny(
        "MptConfig",
        "MptForCausalLM",
        {
            "expansion_ratio": 2,
            "max_seq_len": 128,
            "num_key_value_heads": None,
            "intermediate_size": None,
            "max_position_embeddings": None,
        },
    )
    layers = "transformer.blocks"
    embed_tokens = "transformer.wte"
    final_norm = "transformer.norm_f"
    attention = "attn"
    mlp = "ffn"
    attention_norm = "norm_1"
    mlp_norm = "norm_2"
    output_projection = "out_proj"
    fused_qkv = FusedQKV("Wqkv", "blocks")
    activation = "act"
    down_projection = "down_proj"
    fused_views = ("attention_queries",)
    sizes = Sizes(num_heads=("n_heads",), num_kv_heads=("n_heads",), scale=("softmax_scale",))

    def locations(self):
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_norm_output": ModuleOutput(self.attention_norm),
            "attention_queries": Operation(("torch_matmul_0",), "arg", 0, anchor="torch.matmul(query_states"),
            "attention_keys": Derived(
                Operation(("torch_matmul_0",), "arg", 1, anchor="torch.matmul(query_states"),
                _transposed,
                _untransposed,
                "attention_keys",
            ),
            "attention_scores": Operation(("attention_scores_2",), anchor="masked_fill("),
            "attention_probabilities": Operation(("attn_weights_1",), anchor="dropout("),
            "attention_values": Operation(("torch_matmul_1",), "arg", 1, anchor="torch.matmul(attn_weights"),
            "attention_head_outputs": Operation(("context_states_permute_0",), anchor="permute(0, 2, 1, 3)"),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput("", 0),
            **after_attention(self, mlp_output=ModuleOutput(self.down_projection)),
        }

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return None

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            scores = torch.matmul(queries, keys.transpose(-1, -2)) * heads.scale
            num_queries, num_keys = scores.shape[-2:]
            scores = scores + self.family.alibi(queries.shape[1], num_keys, scores.device)
            visible = self.mask(num_queries, num_keys, None, layer, key_mask, scores.dtype, scores.device) == 0
            return scores.masked_fill(~visible, torch.finfo(queries.dtype).min)

    def alibi(self, num_heads, num_keys, device=None) -> torch.Tensor:
        """The bias added to each head's scores, [heads, 1, key]: slope * (key position - last key position). Float32
        whatever the model's dtype, as MptModel builds it (so half-precision scores are promoted to float32)."""
        distance = torch.arange(1 - num_keys, 1, dtype=torch.int32, device=device)
        return distance[None, None, :] * alibi_slopes(num_heads, device=distance.device)[:, None, None]

    class Identities(identities.Identities):
        def mlp_forward(self, mlp, mlp_input):
            # MptMLP adds the residual it is given; with a zero one its output is the down projection's.
            return mlp(mlp_input, torch.zeros_like(mlp_input))

    kind_notes = {
        "*": {
            "attention_scores": "q·k * softmax_scale + ALiBi (slope_h * (key - last key), alibi_bias_max 8), "
            "masked with masked_fill(finfo.min); float32 in a half-precision model (the bias is float32)",
            "attention_queries": Joined(
                lambda family, config, layer: (
                    f"the fused projection is clamped to +-{clip} (clip_qkv) before the split"
                    if (clip := config.attn_config.clip_qkv)
                    else None
                )
            ),
            **dict.fromkeys(
                ("attention_keys", "attention_values"),
                lambda family, config, layer: (
                    f"clamped to +-{clip} (clip_qkv) before the split"
                    if (clip := config.attn_config.clip_qkv)
                    else None
                ),
            ),
            "mlp_output": "the down projection's output: MptMLP itself returns residual + this",
        }
    }
