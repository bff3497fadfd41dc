"""GPT-OSS: a learned sink logit per head, alternating sliding and full layers, a mixture-of-experts MLP everywhere.

The eager function concatenates each head's sink logit to the masked scores as one extra key column, subtracts the
row maximum, takes the softmax over `key + 1` columns and drops the sink column, so each row of the pattern sums to
`1 - sink share`. `attention_scores` are the masked scores before the sink column is added (their softmax is the
pattern renormalised); `attention_sinks` is the dropped column's probability, a read-only view of the softmax
output. The MLP returns `(output, router scores)`; `mlp_output` is the first item. Every layer routes tokens to
experts that apply their gated activation in a loop over experts, so no activation or neuron tensor exists.
"""

from ..family import Family, Joined, Tiny, VLLMLayout
from ..parts.moe import SparseMoE
from ..parts.sinks import SINK_NOTE, eager_with_sinks, sink_share, with_sinks

MOE_REASON = (
    "a mixture-of-experts layer: the routed experts apply their clamped gated activation inside a loop "
    "over experts, each to the tokens routed to it, so no [batch, seq, intermediate] tensor exists"
)


def _gptoss_vllm_locations(family):
    from ..locations.vllm import RebuiltPattern, ResidualPair

    locations = Family.vllm.locations(family)
    block_input = {"first": 0, "second": 2}
    locations["embeddings"] = ResidualPair(f"{family.path('layers', 'vllm')}.0", "input", **block_input)
    locations["layer_input"] = ResidualPair("", "input", **block_input)
    return with_sinks(locations, RebuiltPattern(family.vllm.kernel, "sinks"))


class GptOss(SparseMoE, Family):
    model_types = ("gpt_oss",)
    tiny = Tiny(
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "head_dim": 16,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            # GPT-OSS's yarn rope, scaled to the tiny context (the default's 4096 original positions would warn)
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
        },
    )
    eager = eager_with_sinks(probabilities=("attn_weights_2", "dropout("))
    sink_operation = "probs_0"
    absent = {"mlp_activation": MOE_REASON, "mlp_neurons": MOE_REASON}

    # vLLM (model_executor/models/gpt_oss.py): the attention block is `attn`, and the decoder block takes
    # (hidden, positions, residual); the kernel applies the sink logits itself, and attnlens's rebuilt softmax too.
    vllm = VLLMLayout(model_types=("gpt_oss",), names={"attention": "attn"}, locations=_gptoss_vllm_locations)

    def locations(self):
        return with_sinks(super().locations(), sink_share(self.sink_operation))

    kind_notes = {
        "*": {
            "attention_sinks": SINK_NOTE,
            "attention_probabilities": Joined(
                "rows sum to 1 - attention_sinks: the sink column is dropped after the softmax.", sep=" ", before=True
            ),
        }
    }
