"""Granite SWA: Granite's multipliers with sliding-window layers and a learned sink per head applied *after* the mix.

The eager function takes an ordinary softmax of the masked scores (rows sum to one: `attention_probabilities`), mixes
the values with it (`attention_head_outputs`), then multiplies each head's output at each query by
`sigmoid(logsumexp(scores) - sink)`: the factor a sink logit in the softmax's denominator would leave. attnlens serves
that factor as `attention_gate` (one number per head and query, repeated over `head_dim`): `head_outputs * gate`,
merged, is the premix, and `1 - gate` is the share a sink would take. `attention_sinks` is unavailable because no
pattern row here falls short of one. Layers rotate queries and keys only where the model passes rotary embeddings.

vLLM runs Granite SWA with its Granite class (model_executor/models/granite.py), the sink as a logit in its kernel's
softmax: the kernel returns the rescaled mix, so the premix is the same, but the mix before the rescaling (the head
outputs) is never formed there. On vLLM `attention_gate` is rebuilt from the rebuilt scores and the kernel's sink
logits (`SinkGate`), and the pattern, rebuilt without the sink column as on eager, is read-only (an edited pattern's
head outputs would be recomputed at the output projection without the rescaling).
"""

from dataclasses import dataclass, replace

import torch

from ..family import INTERFACE_CALL
from ..locations import Derived, Location, Operation
from ..locations.vllm import RebuiltPattern, worker_of
from ..parts import scoring
from .granite import Granite

#: Why an edited pattern cannot reach vLLM here, and why the head outputs are not served there.
KERNEL_SINK = (
    "vLLM's kernel applies the sink as a logit in its softmax, so it returns the mix already rescaled by "
    "the sink's factor"
)

SINK_AS_GATE = (
    "the sink is applied after the mix, as a rescaling of each head's output by sigmoid(logsumexp(scores) "
    "- sink): served as attention_gate (1 - gate is the sink's share); the pattern's rows sum to one"
)


def _per_head_dim(envoy, scale):
    # [batch, heads, query] -> [batch, query, heads, head_dim], a copy (the forward holds one scale per head and query)
    return scale.transpose(1, 2)[..., None].expand(-1, -1, -1, envoy._module.head_dim).clone()


def _heads_last(envoy, per_head):
    return per_head.transpose(1, 2)


def _heads_first(envoy, old, new):
    return new.transpose(1, 2)


@dataclass(frozen=True)
class SinkGate(Location):
    """`attention_gate` on vLLM: sigmoid(logsumexp(scores) - sink) per head and query, from the worker's rebuilt scores
    and the kernel's sink logits, repeated over head_dim as on eager. Read-only."""

    kernel: str

    in_place = False
    writable = False
    why_not = f"it is rebuilt from the scores and the sink logits: {KERNEL_SINK}; edit the queries or keys instead"
    note = "rebuilt in vLLM's worker from the rebuilt scores and the kernel's sink logits (read-only)"

    @property
    def key(self) -> str:
        return f"{self.kernel}.input"

    def read(self, envoy):
        worker = worker_of(envoy)
        layer = worker.access.layer_of(envoy)
        scores = worker.pattern(envoy, self.kernel)["scores"]  # [1, heads, queries, keys]
        gate = torch.sigmoid(scores.float().logsumexp(-1) - worker.sinks[layer].float()[None, :, None])
        return gate.transpose(1, 2)[..., None].expand(-1, -1, -1, worker.geometry[layer].head_dim).to(scores.dtype)


@dataclass(frozen=True)
class SinklessPattern(RebuiltPattern):
    """The pattern rebuilt without the kernel's sink column (rows sum to one, as on eager): read-only."""

    in_place = False
    writable = False
    why_not = (
        f"{KERNEL_SINK}; attnlens's worker would recompute an edited pattern's head outputs without it; edit "
        f"the queries or keys instead"
    )


def _sinkscale_vllm_locations(family):
    locations = Granite.vllm.locations(family)  # Granite's unpaired residual stream, then the sink as the gate
    kernel = family.vllm.kernel
    ordered = {}
    for name, location in locations.items():
        if name == "attention_probabilities":  # where the eager order has it
            ordered["attention_gate"] = SinkGate(kernel)
        if name in ("attention_scores", "attention_probabilities"):
            location = SinklessPattern(kernel, location.kind)
        if name != "attention_head_outputs":
            ordered[name] = location
    return ordered


class SinkScale:
    """Mixin: the eager function rescales each head's output by its sink factor after the mix (Granite SWA)."""

    absent = {**Granite.absent, "attention_sinks": SINK_AS_GATE}
    vllm = replace(
        Granite.vllm,
        locations=_sinkscale_vllm_locations,
        unavailable={
            **Granite.vllm.unavailable,
            "attention_head_outputs": f"{KERNEL_SINK}: the mix before that rescaling is never formed; attention_premix "
            f"is "
            f"head outputs * attention_gate, merged",
        },
    )

    class ScoreFunction(scoring.ScoreFunction):
        def softmax(self, scores, sinks=None):
            """The pattern without the sink column, on either engine: the sink rescales the mix (served as the gate)."""
            return super().softmax(scores)

    def locations(self):
        locations = super().locations()
        gate = Derived(
            Operation((INTERFACE_CALL, "sink_scale_0"), anchor="sigmoid()"),
            _per_head_dim,
            None,
            "attention_gate",
            in_place=False,
            why_not="the forward holds one scale per head and query (repeated here over head_dim); edit "
            "the scores or the head outputs instead",
        )
        heads = Derived(
            Operation((INTERFACE_CALL, "attn_output_0"), anchor="torch.matmul(attn_weights, value_states)"),
            _heads_last,
            _heads_first,
            "attention_head_outputs (the mix before the sink's rescaling)",
        )
        ordered = {}
        for name, location in locations.items():
            if name == "attention_probabilities":  # the factor is computed from the scores, before the softmax
                ordered["attention_gate"] = gate
            ordered[name] = heads if name == "attention_head_outputs" else location
        return ordered

    kind_notes = {
        "*": {
            "attention_gate": "sigmoid(logsumexp(scores) - sink) per head and query, repeated over head_dim: the "
            "sink's rescaling of each head's output (1 - gate is the sink's share); read-only",
            "attention_head_outputs": "pattern @ values, before the sink's rescaling (a transposed view)",
        }
    }


class GraniteSWA(SinkScale, Granite):
    model_types = ("granite_swa",)
    vllm = replace(
        SinkScale.vllm,
        model_types=("granite_swa",),  # vLLM's Granite class
    )
    tiny = (
        "GraniteSWAConfig",
        "GraniteSWAForCausalLM",
        {
            **Granite.tiny[2],
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    )
