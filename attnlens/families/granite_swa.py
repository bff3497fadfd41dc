"""Granite SWA: Granite's multipliers with sliding-window layers and a learned sink per head applied *after* the mix.

The eager function takes an ordinary softmax of the masked scores (rows sum to one: `attention_probabilities`), mixes
the values with it (`attention_head_outputs`), then multiplies each head's output at each query by
`sigmoid(logsumexp(scores) - sink)`: the factor a sink logit in the softmax's denominator would leave. attnlens serves
that factor as `attention_gate` (one number per head and query, repeated over `head_dim`): `head_outputs * gate`,
merged, is the premix, and `1 - gate` is the share a sink would take. `attention_sinks` is unavailable because no
pattern row here falls short of one. Layers rotate queries and keys only where the model passes rotary embeddings.
"""

from ..family import INTERFACE_CALL, Tiny
from ..locations import Derived, Operation
from .granite import Granite

SINK_AS_GATE = ("the sink is applied after the mix, as a rescaling of each head's output by sigmoid(logsumexp(scores) "
                "- sink): served as attention_gate (1 - gate is the sink's share); the pattern's rows sum to one")


def _per_head_dim(envoy, scale):
    # [batch, heads, query] -> [batch, query, heads, head_dim], a copy (the forward holds one scale per head and query)
    return scale.transpose(1, 2)[..., None].expand(-1, -1, -1, envoy._module.head_dim).clone()


def _heads_last(envoy, per_head):
    return per_head.transpose(1, 2)


def _heads_first(envoy, old, new):
    return new.transpose(1, 2)


class SinkScale:
    """Mixin: the eager function rescales each head's output by its sink factor after the mix (Granite SWA)."""

    absent = {**Granite.absent, "attention_sinks": SINK_AS_GATE}

    def locations(self):
        locations = super().locations()
        gate = Derived(Operation((INTERFACE_CALL, "sink_scale_0"), anchor="sigmoid()"), _per_head_dim, None,
                       "attention_gate", in_place=False,
                       why_not="the forward holds one scale per head and query (repeated here over head_dim); edit "
                               "the scores or the head outputs instead")
        heads = Derived(Operation((INTERFACE_CALL, "attn_output_0"), anchor="torch.matmul(attn_weights, value_states)"),
                        _heads_last, _heads_first, "attention_head_outputs (the mix before the sink's rescaling)")
        ordered = {}
        for name, location in locations.items():
            if name == "attention_probabilities":  # the factor is computed from the scores, before the softmax
                ordered["attention_gate"] = gate
            ordered[name] = heads if name == "attention_head_outputs" else location
        return ordered

    def notes(self, config, layer, engine="transformers"):
        return {**super().notes(config, layer, engine),
                "attention_gate": "sigmoid(logsumexp(scores) - sink) per head and query, repeated over head_dim: the "
                                  "sink's rescaling of each head's output (1 - gate is the sink's share); read-only",
                "attention_head_outputs": "pattern @ values, before the sink's rescaling (a transposed view)"}


class GraniteSWA(SinkScale, Granite):
    model_types = ("granite_swa",)
    tiny = Tiny("GraniteSWAConfig", "GraniteSWAForCausalLM", {
        **Granite.tiny[2], "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention",
                                                                 "sliding_attention"]})
