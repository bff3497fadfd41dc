"""MiMo-V2-Flash: sinks and more key/value heads on its sliding-window layers only; values narrower than keys.

Queries and keys have `head_dim` channels per head (`qk_head_dim`), values and head outputs `v_head_dim`. Sliding
layers have twice `config.num_key_value_heads` key/value heads and a learned sink logit per head (the pattern's rows
sum to `1 - attention_sinks`, as on GPT-OSS); full layers have neither. The forward multiplies the values by
`config.attention_value_scale` before the attention function, so `attention_values` are `v_proj`'s output times that
scale, the tensor the heads mix. The eager function always subtracts the row maximum before the softmax;
`attention_scores` are the masked scores before that (and before any sink column). `mlp_layer_types` chooses a dense
MLP or a routed mixture of experts (no shared experts) per layer.
"""

from ..family import Family, Tiny, VLLMLayout
from ..parts.moe import SparseMoE
from ..parts.sinks import SINK_NOTE, eager_with_sinks, sink_share, with_sinks
from ..parts.sizes import Sizes, kv_heads_from_groups

MOE_REASON = (
    "a mixture-of-experts layer (mlp_layer_types 'sparse'): the routed experts apply the activation inside "
    "a loop over experts, each to the tokens routed to it, so no [batch, seq, intermediate] tensor exists; "
    "the 'dense' layers serve it"
)


class MiMoV2Flash(SparseMoE, Family):
    model_types = ("mimo_v2_flash",)
    tiny = Tiny(
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        {
            "head_dim": 16,
            "v_head_dim": 8,
            "attention_value_scale": 0.5,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
        },
    )
    eager = eager_with_sinks(probabilities=("attn_weights_4", "dropout("))
    vllm = VLLMLayout(
        refusal="vLLM's MiMoV2FlashForCausalLM reads its authors' config format, not transformers': "
        "\"'MiMoV2FlashConfig' object has no attribute 'hybrid_layer_pattern'\" (vLLM 0.32, building the "
        "model from transformers' mimo_v2_flash config)",
    )
    absent = {
        "attention_sinks": "a full-attention layer: MiMo-V2-Flash gives sink logits only to its sliding-window "
        "layers, so every row of this layer's pattern sums to one",
        "mlp_activation": MOE_REASON,
        "mlp_neurons": MOE_REASON,
    }
    sizes = Sizes(num_kv_heads=(kv_heads_from_groups,), head_dim=("v_head_dim",), qk_head_dim=("head_dim",))

    def moe_layer(self, config, layer):
        return config.mlp_layer_types[layer] == "sparse"

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"sinks"} if config.layer_types[layer] == "sliding_attention" else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "sinks" in kind and engine == "transformers":
            return with_sinks(locations, sink_share("probs_0"))
        return locations

    @staticmethod
    def value_scale(config) -> float:
        return config.attention_value_scale if config.attention_value_scale is not None else 1.0

    kind_notes = {
        "*": {
            "attention_values": lambda family, config, layer: (
                f"v_proj's output times attention_value_scale={family.value_scale(config)}: the forward scales the "
                "values before the attention function, so these are what the heads mix"
            ),
        },
        "sinks": {
            "attention_sinks": SINK_NOTE,
            "attention_keys": lambda family, config, layer: (
                f"{2 * config.num_key_value_heads} key/value heads on this sliding layer (twice "
                f"config.num_key_value_heads)"
            ),
        },
    }
