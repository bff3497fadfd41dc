"""Bloom: ALiBi, its own attention arithmetic on heads folded into the batch, and an attention module that adds the
residual itself.

`BloomAttention` splits the fused `query_key_value` per head, reshapes queries, keys and values to
[batch * heads, seq, head_dim] (keys transposed) and computes `alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(d))`: the
scores are `q @ k^T / sqrt(d) + slope * key position`, then `+ attention_mask`. The queries, keys and values are
views of those [batch * heads] tensors as [batch, heads, seq, head_dim] (true views: in-place edits land); the
head outputs are a view of `torch.bmm(probs, values)`.

The attention module returns `residual + dense(heads merged)`, so `attention_output` is the output projection's
output (not the module's) and `layer_mid` is the module's output. Likewise `BloomMLP` adds the residual:
`mlp_output` is its down projection's output. With `config.apply_residual_connection_post_layernorm` the block adds
each sublayer's output to its norm's output, not to the stream: `layer_mid = attention_norm_output +
attention_output` and `layer_output = mlp_norm_output + mlp_output` (`residual_add`). With `pretraining_tp > 1`
and `slow_but_exact` the projections run as sliced `F.linear` calls and `dense` is never called.

vLLM's Bloom keeps these module names without the residual inside the modules, hands its kernel the same ALiBi slopes
(`alibi_slopes`), and computes a different MLP: the exact GELU where transformers' Bloom uses its tanh approximation
(`VLLM_GELU`).
"""

import torch

from ..family import Family, Tiny, VLLMLayout, after_attention
from ..locations import Derived, ModuleInput, ModuleOutput, Operation
from ..parts import identities, scoring
from ..parts.alibi import alibi_slopes, key_positions
from ..parts.fused import FusedQKV
from ..parts.mirrored import mirrored
from ..parts.sizes import Sizes

VLLM_GELU = (
    "vLLM's BloomMLP uses the exact GELU (erf) where transformers' Bloom uses its tanh approximation "
    "(bloom_gelu_forward): the two differ by up to 4.7e-4 per activation, so from the first MLP on vLLM's "
    "values differ from the transformers engine's by about 1e-3 relative (9.4e-4 in the patterns of a tiny "
    "random checkpoint)"
)


def _split(envoy, folded):
    """[batch * heads, seq, dim] -> [batch, heads, seq, dim], a view."""
    heads = envoy._module.num_heads
    return folded.view(folded.shape[0] // heads, heads, *folded.shape[1:])


def _fold(envoy, old, new):
    return new.reshape(old.shape)


def _split_keys(envoy, folded_transposed):
    return _split(envoy, folded_transposed.transpose(-1, -2))


def _fold_keys(envoy, old, new):
    return new.reshape(-1, *new.shape[2:]).transpose(-1, -2)


def _heads(envoy, mix):
    return _split(envoy, mix).transpose(1, 2)


def _unheads(envoy, old, new):
    return new.transpose(1, 2).reshape(old.shape)


def _bloom_vllm_locations(family):
    from ..locations import ModuleArgument
    from ..locations.vllm import batched

    # vLLM's block is called as layer(positions, hidden_states)
    return {**mirrored(family, family.locations(), own_port=True), "layer_input": batched(ModuleArgument("", 1))}


class Bloom(Family):
    model_types = ("bloom",)
    tiny = Tiny(
        "BloomConfig",
        "BloomForCausalLM",
        {"num_key_value_heads": None, "intermediate_size": None, "max_position_embeddings": None},
        layouts={"post_norm_residual": {"apply_residual_connection_post_layernorm": True}},
    )
    layers = "transformer.h"
    embed_tokens = "transformer.word_embeddings"
    final_norm = "transformer.ln_f"
    attention = "self_attention"
    output_projection = "dense"
    fused_qkv = FusedQKV("query_key_value", "groups")
    activation = "gelu_impl"
    down_projection = "dense_4h_to_h"
    vllm = VLLMLayout(
        locations=_bloom_vllm_locations,
        model_types=("bloom",),  # vLLM's own BloomForCausalLM
        tiny={"hidden_size": 128},  # head size 32
        tolerance=2e-3,  # vLLM's exact GELU (VLLM_GELU) moves the values by up to 1e-3
    )
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_heads",), scale=("inv_norm_factor",))

    def locations(self):
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_norm_output": ModuleOutput(self.attention_norm),
            "attention_queries": Derived(
                Operation(("query_layer_0",), anchor="query_layer.reshape("), _split, _fold, "attention_queries"
            ),
            "attention_keys": Derived(
                Operation(("key_layer_0",), anchor="key_layer.reshape("), _split_keys, _fold_keys, "attention_keys"
            ),
            "attention_values": Derived(
                Operation(("value_layer_0",), anchor="value_layer.reshape("), _split, _fold, "attention_values"
            ),
            "attention_scores": Operation(("attn_weights_1",), anchor="+ attention_mask"),
            "attention_probabilities": Operation(("attention_probs_1",), anchor="self.attention_dropout("),
            "attention_head_outputs": Derived(
                Operation(("torch_bmm_0",), anchor="torch.bmm("), _heads, _unheads, "attention_head_outputs"
            ),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput(self.output_projection),
            **after_attention(self, mlp_output=ModuleOutput(self.down_projection)),
        }

    class ScoreFunction(scoring.ScoreFunction):
        def alibi_slopes(self, config, layer: int) -> torch.Tensor:
            """The per-head slopes vLLM's kernel adds (times the key's distance, after the scale), float32: Bloom's."""
            return alibi_slopes(config.num_attention_heads)

        def sliding_window(self, config, layer):
            return None

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            batch, num_heads, num_queries, dim = queries.shape
            num_keys = keys.shape[2]
            alibi = self.family.alibi(num_heads, num_keys, key_mask, queries.dtype, queries.device)
            alibi = alibi.expand(batch, num_heads, 1, num_keys)
            folded_queries = queries.reshape(batch * num_heads, num_queries, dim)
            folded_keys = keys.reshape(batch * num_heads, num_keys, dim).transpose(1, 2)
            scores = alibi.reshape(batch * num_heads, 1, num_keys).baddbmm(
                folded_queries, folded_keys, beta=1.0, alpha=heads.scale
            )
            mask = self.mask(num_queries, num_keys, None, layer, key_mask, scores.dtype, scores.device)  # no window
            return scores.view(batch, num_heads, num_queries, num_keys) + mask

    def alibi(self, num_heads, num_keys, key_mask=None, dtype=torch.float32, device=None) -> torch.Tensor:
        """The bias added to each head's scores, [batch or 1, heads, 1, key]: slope * key position."""
        positions = key_positions(num_keys, key_mask, device)
        bias = alibi_slopes(num_heads, positions.device)[None, :, None] * positions[:, None, :]
        return bias.to(dtype)[:, :, None]

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            if block.apply_residual_connection_post_layernorm:  # the block adds to the norm's output, not to the stream
                norm = block.input_layernorm if sublayer == "attention" else block.post_attention_layernorm
                return norm(stream) + update
            return stream + update

        def mlp_forward(self, mlp, mlp_input):
            # BloomMLP adds the residual it is given; with a zero one its output is the down projection's.
            return mlp(mlp_input, torch.zeros_like(mlp_input))

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        if config.pretraining_tp > 1 and config.slow_but_exact:
            why = (
                f"config.pretraining_tp={config.pretraining_tp} with slow_but_exact=True runs the {{}} as sliced "
                f"F.linear calls, so `{{}}` is never called; load with slow_but_exact=False"
            )
            reasons["attention_premix"] = reasons["attention_output"] = why.format("output projection", "dense")
            reasons["mlp_neurons"] = reasons["mlp_output"] = why.format("MLP's down projection", "dense_4h_to_h")
        return reasons

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        notes["embeddings"] = "the token embedding's output; word_embeddings_layernorm follows it before block 0"
        notes["attention_scores"] = (
            "q·k/sqrt(d) + ALiBi (slope_h * key position, positions counting real tokens only), + the causal mask"
        )
        if engine == "vllm":
            notes["attention_scores"] += (
                "; vLLM's kernel adds slope_h * (key - query position) instead, which "
                "shifts each row by a constant: the same pattern"
            )
            notes["mlp_activation"] = VLLM_GELU
        else:
            notes["attention_output"] = (
                "the output projection's output: the attention module itself returns residual + this"
            )
            notes["mlp_output"] = "the down projection's output: BloomMLP itself returns residual + this"
        if config.apply_residual_connection_post_layernorm:
            notes["layer_mid"] = (
                "apply_residual_connection_post_layernorm: attention_norm_output + attention_output "
                "(the block adds attention to the normed input, not to layer_input)"
            )
            notes["layer_output"] = (
                "apply_residual_connection_post_layernorm: mlp_norm_output + mlp_output (the "
                "block adds the MLP to the normed stream, not to layer_mid)"
            )
        return notes
