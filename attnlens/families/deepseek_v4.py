"""DeepSeek-V4: one shared key/value head, attention sinks, compressed long-range keys, a grouped low-rank output
projection and hyper-connections in place of a single residual stream.

- Keys and values are one tensor: `kv_proj` makes a single head (`num_kv_heads == 1`), normed and given the rotary
  embedding on its trailing `qk_rope_head_dim` channels, and the attention function receives it as both key and
  value. `attention_keys` and `attention_values` read that same tensor: an in-place edit of one edits both;
  assigning one replaces only that argument.
- Sinks as on GPT-OSS: the pattern's rows sum to `1 - attention_sinks`.
- Because the values carry the rotary embedding, each head's output is rotated back (the inverse rotation at the
  query's position, on the trailing slice) before the output projection. `attention_head_outputs` is the attention
  function's output, `probabilities @ values`, still rotated; `attention_premix` is what the grouped projection
  `o_a_proj` receives after the inverse rotation, `[batch, seq, o_groups, heads*head_dim/o_groups]` flattened to
  `[batch, seq, heads*head_dim]`; `o_b_proj` then mixes the groups.
- Every layer masks to a sliding window. Compressed layers (`compressed_sparse_attention`,
  `heavily_compressed_attention`) also append the compressor's pooled entries to the keys, one per `compress_rate`
  tokens (chosen per query by the indexer on CSA layers), with their own mask: their key axis is not the sequence.
- Hyper-connections: the residual is `hc_mult` streams `[batch, seq, hc_mult, hidden]`. Each sublayer reads a
  learned weighted collapse of the streams (`attn_hc`, `ffn_hc`) and writes `post * output + comb^T @ streams`
  back; the model collapses the last streams with `hc_head` before the final norm. `layer_input`, `layer_mid` and
  `layer_output` are the streams.
"""

import sys

import torch

from ..family import Family, Tiny, VLLMLayout
from ..locations import Derived, ModuleInput
from ..parts import identities, scoring
from ..parts.moe import SparseMoE
from ..parts.sinks import SINK_NOTE, eager_with_sinks, sink_share, with_sinks
from ..parts.sizes import Sizes, kv_heads_from_groups

MOE_REASON = (
    "a mixture-of-experts layer (every DeepSeek-V4 layer): the routed experts apply their clamped gated "
    "activation inside a loop over experts, each to the tokens routed to it, so no [batch, seq, "
    "intermediate] tensor exists (the shared expert, mlp.shared_experts, is one part of the sum)"
)
KEY_AXIS = ("attention_keys", "attention_values", "attention_scores", "attention_sinks", "attention_probabilities")
STREAMS = "the {} hyper-connection streams [batch, seq, hc_mult, hidden], {}"
SHARED_KV = (
    "the shared key/value head [batch, 1, seq, head_dim]: one tensor passed as both key and value, with the rotary "
    "embedding on its trailing {config.qk_rope_head_dim} channels; an in-place edit of keys or values edits both, "
    "assigning one replaces only that argument"
)


def _compressed_reason(layer_type: str) -> str:
    picked = " (the lightning indexer picks which per query)" if layer_type == "compressed_sparse_attention" else ""
    return (
        f"a {layer_type} layer: the compressor appends one pooled key/value entry per compress_rate tokens to "
        f"the sliding-window keys{picked}, so the key axis is seq + seq // compress_rate and the mask is "
        f"extended with the compressor's own block bias; the catalogue's [.., seq, ..] key axis cannot hold "
        f"them. The sliding_attention layers serve this value"
    )


def _flatten_groups(envoy, grouped):
    return grouped.flatten(2)


def _unflatten_groups(envoy, grouped, premix):
    return premix.reshape(grouped.shape)


class DeepseekV4(SparseMoE, Family):
    model_types = ("deepseek_v4",)
    tiny = Tiny(
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        {
            "num_key_value_heads": 1,
            "head_dim": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "intermediate_size": None,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "o_groups": 2,
            "o_lora_rank": 16,
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_topk": 2,
            "hc_mult": 2,
            "num_nextn_predict_layers": 0,
            # rates small enough that the 18-token test prompt fills compressor windows on both compressed kinds
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            "layer_types": ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
            "mlp_layer_types": ["moe", "moe", "moe"],
        },
    )
    output_projection = "o_a_proj"
    eager = eager_with_sinks(probabilities=("attn_weights_2", "dropout("))
    absent = {"mlp_activation": MOE_REASON, "mlp_neurons": MOE_REASON}
    vllm = VLLMLayout(
        refusal="vLLM reads DeepSeek-V4's config in its authors' format, not transformers': \"The "
        "`mlp_layer_types` entries must be in ('sparse', 'dense')\" (vLLM 0.32, on transformers' "
        "deepseek_v4 config, whose entries are 'moe')",
    )
    attention_streams, mlp_streams, final_streams = "attn_hc", "ffn_hc", "model.hc_head"
    sizes = Sizes(num_kv_heads=(kv_heads_from_groups,))

    def locations(self):
        locations = super().locations()
        locations["attention_premix"] = Derived(
            ModuleInput(self.output_projection), _flatten_groups, _unflatten_groups, "attention_premix"
        )
        locations["layer_mid"] = ModuleInput(self.mlp_streams)
        return with_sinks(locations, sink_share("probs_0"))

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind if config.layer_types[layer] == "sliding_attention" else kind | {"compressed"}

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "compressed" in kind:
            locations = {name: location for name, location in locations.items() if name not in KEY_AXIS}
        return locations

    kind_reasons = {
        "compressed": dict.fromkeys(
            KEY_AXIS, lambda family, config, layer: _compressed_reason(config.layer_types[layer])
        )
    }

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return config.sliding_window  # every layer type uses the sliding-window mask

    class Identities(identities.Identities):
        def project_output(self, module, premix):
            grouped = premix.reshape(*premix.shape[:2], module.config.o_groups, -1)
            return module.o_b_proj(module.o_a_proj(grouped).flatten(2))

        def merge_heads(self, module, heads):
            """Rotate each head's output back at its query's position (positions 0.. of a prefill), then merge."""
            transformers_module = sys.modules[type(module).__module__]
            positions = torch.arange(heads.shape[1], device=heads.device)[None]
            cos, sin = transformers_module.DeepseekV4RotaryEmbedding(module.config)(
                heads, positions, layer_type=module.rope_layer_type
            )
            rotated = transformers_module.apply_rotary_pos_emb(heads.transpose(1, 2), cos, -sin).transpose(1, 2)
            return rotated.reshape(*heads.shape[:2], -1)

        def residual_add(self, block, sublayer, stream, update):
            post, comb, _ = getattr(
                block, self.family.attention_streams if sublayer == "attention" else self.family.mlp_streams
            )(stream)
            return post.to(stream.dtype).unsqueeze(-1) * update.unsqueeze(-2) + torch.matmul(
                comb.to(stream.dtype).transpose(-1, -2), stream
            )

        def residual_read(self, owner, sublayer, stream):
            if sublayer == "final":
                for part in self.family.final_streams.split("."):
                    owner = getattr(owner, part)
                return owner(stream)
            return getattr(
                owner, self.family.attention_streams if sublayer == "attention" else self.family.mlp_streams
            )(stream)[2]

    kind_notes = {
        "*": {
            "attention_probabilities": None,  # the window's note: the sliding layers' below says it
            "layer_input": STREAMS.format(
                "{config.hc_mult}", "entering the block; attn_hc collapses them into what input_layernorm reads"
            ),
            "layer_mid": STREAMS.format(
                "{config.hc_mult}",
                "after attention: post * attention_output + comb^T @ layer_input (attn_hc's weights); ffn_hc's input",
            ),
            "layer_output": STREAMS.format(
                "{config.hc_mult}", "leaving the block: post * mlp_output + comb^T @ layer_mid (ffn_hc's weights)"
            ),
            "attention_head_outputs": "probabilities @ values: each head's output still carries the values' rotary "
            "embedding on its trailing slice (the forward rotates it back before o_a_proj)",
            "attention_premix": "o_a_proj's input [batch, seq, o_groups={config.o_groups}, heads*head_dim/o_groups] "
            "flattened: the head outputs rotated back at their query's position, merged; a view, so in-place edits "
            "land, and assignment is reshaped back",
            "attention_output": "o_b_proj(o_a_proj(premix by groups)): the grouped low-rank output projection",
            "final_norm_output": "norm(hc_head(last layer_output)): hc_head collapses the streams before the norm",
        },
        "sliding_attention": {
            **dict.fromkeys(("attention_keys", "attention_values"), SHARED_KV),
            "attention_sinks": SINK_NOTE,
            "attention_probabilities": "sliding window of {config.sliding_window} keys; rows sum to "
            "1 - attention_sinks",
        },
    }
