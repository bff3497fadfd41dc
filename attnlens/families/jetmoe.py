"""JetMoE: a mixture of attention heads (MoA) and a sparse mixture-of-experts MLP on every layer.

The attention's query and output projections are experts (`self_attention.experts`, `JetMoeMoA`): a router picks each
token's `top_k` experts from the attention's input (`attention_norm_output`), `experts.map` projects the token's
queries with each chosen expert's `input_linear`, and `experts.reduce` projects each head group's output with the same
expert's `output_linear`, weights it by the expert's gate, sums over the chosen experts and adds `experts.bias`. Keys
and values have one projection shared by every expert (`kv_proj`).

Heads: `num_heads = top_k * num_kv_heads`. Query head `j` is slot `j // num_kv_heads` of key/value head
`j % num_kv_heads`: the query projection by the token's `(j // num_kv_heads)`-th chosen expert (ordered by router
logit, highest first), so one head index holds different experts' queries at different positions. The forward tiles
the keys and values (`repeat(1, top_k, 1, 1)`, not transformers' `repeat_interleave`): `repeat_kv` says so, and the
score function, the identities and `per_head_value` pair heads that way. Keys and values are read as the attention
function receives them with the tiling undone (`[:, :num_kv_heads]` of the tiled tensor, a copy: in-place edits
cannot reach every tile and are refused; an assignment is tiled back).

Everything between the projections is the common attention interface: the queries (after rotary), the scores and the
pattern (eager), and each head's output before the output experts are the tensors the forward holds. The premix is
what `experts.reduce` receives, `[batch, seq, top_k, num_kv_heads * head_dim]` merged to `[batch, seq, heads *
head_dim]` (a view). `attention_output` is `reduce`'s result: the gate-weighted sum of the chosen experts'
projections plus the bias (`project_routed_output` reroutes the attention's input to check it).
"""

from ..family import INTERFACE_CALL, Family, Tiny, VLLMLayout
from ..locations import Derived, ModuleOutput, Operation
from ..parts import identities, scoring
from ..parts.moe import PER_EXPERT, SparseMoE
from ..parts.vllm import computes_otherwise

REDUCE = "self_experts_reduce_0"  # JetMoeMoA.reduce, the output experts, called from JetMoeAttention.forward

EXPERT_MLP = (
    "a sparse mixture of experts: no [batch, seq, intermediate] tensor exists. JetMoeMoE.forward groups "
    "the flattened tokens by expert (each token once per chosen expert) and forms act(gate) * up as "
    "[tokens * top_k, intermediate] between input_linear and output_linear, one expert's rows after "
    "another; mlp_output is the routing-weighted sum of the chosen experts plus the MoE's bias"
)


def _untile(envoy, tiled):
    return tiled[:, : tiled.shape[1] // envoy._module.top_k]


def _tile(envoy, old, new):
    return new.repeat(1, envoy._module.top_k, 1, 1)


def _merge(envoy, grouped):
    return grouped.flatten(2)


def _unmerge(envoy, old, new):
    return new.view(old.shape)


UNTILED = (
    "a copy of the first of the top_k tiles the attention function receives: an in-place edit would reach one "
    "tile only; assign the value instead (it is tiled back)"
)


class JetMoe(SparseMoE, Family):
    model_types = ("jetmoe",)
    vllm = VLLMLayout(
        refusal=computes_otherwise(
            "JetMoe",
            "on the tiny checkpoint (TransformersMoEForCausalLM, head size 32) its first greedy token already "
            "differs from transformers', log-probabilities 0.78 apart",
        )
    )
    tiny = Tiny(
        "JetMoeConfig", "JetMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "kv_channels": 16}
    )
    attention = "self_attention"
    output_projection = "experts"
    activation = None
    down_projection = "output_linear"
    absent = {**Family.absent, **dict.fromkeys(PER_EXPERT, EXPERT_MLP)}

    def locations(self):
        return {
            **super().locations(),
            "attention_keys": Derived(
                Operation((INTERFACE_CALL,), "arg", 2),
                _untile,
                _tile,
                "attention_keys (held tiled top_k times)",
                in_place=False,
                why_not=UNTILED,
            ),
            "attention_values": Derived(
                Operation((INTERFACE_CALL,), "arg", 3),
                _untile,
                _tile,
                "attention_values (held tiled top_k times)",
                in_place=False,
                why_not=UNTILED,
            ),
            "attention_premix": Derived(
                Operation((REDUCE,), "arg", 0, anchor="experts.reduce"),
                _merge,
                _unmerge,
                "attention_premix (held as [.., top_k, kv_heads * head_dim])",
            ),
            "attention_output": ModuleOutput("", 0),
        }

    class ScoreFunction(scoring.ScoreFunction):
        def repeat_kv(self, tensor, groups):
            return tensor.repeat(1, groups, 1, 1)

    class Identities(identities.Identities):
        def project_routed_output(self, module, premix, attention_input):
            experts = module.experts
            if attention_input is None:
                raise ValueError("JetMoE's output experts are routed by the attention's input: pass it")
            flat = attention_input.reshape(-1, attention_input.shape[-1])
            index_sorted_experts, batch_index, batch_gates, expert_size, _ = experts.router(flat)
            grouped = premix.view(*premix.shape[:2], module.top_k, -1)
            return experts.reduce(grouped, (index_sorted_experts, batch_index, batch_gates, expert_size))

        def project_output(self, module, premix):
            raise NotImplementedError("JetMoE's output projection is routed per token: use project_routed_output")

    kind_notes = {
        "*": {
            "attention_queries": "query head j is the query projection by the token's "
            "(j // {config.num_key_value_heads})-th chosen attention expert (of {config.num_experts_per_tok}, "
            "highest router logit first) for key/value head j % {config.num_key_value_heads}: one head index "
            "holds different experts' queries at different "
            "positions",
            "attention_keys": "tiled, not interleaved: query head j reads key head "
            "j % {config.num_key_value_heads}; " + UNTILED,
            "attention_values": "tiled, not interleaved: query head j reads value head "
            "j % {config.num_key_value_heads}; " + UNTILED,
            "attention_head_outputs": "before the output experts: head j goes to the token's (j // "
            "{config.num_key_value_heads})-th chosen expert's output_linear",
            "attention_premix": "what the output experts (experts.reduce) receive, [.., top_k, kv_heads * head_dim] "
            "merged (a view)",
            "attention_output": "experts.reduce: each chosen expert's output_linear of its slot's heads, weighted by "
            "its gate, summed, plus experts.bias",
            "mlp_output": "the MoE's output: the routing-weighted sum of the chosen experts plus its bias",
        }
    }
