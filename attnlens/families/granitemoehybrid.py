"""Granite 4.0 hybrid (GraniteMoeHybrid): Mamba-2 layers and attention layers with Granite's multipliers, a shared MLP
in every block and, where `num_local_experts > 0`, routed experts beside it.

Layers whose `config.layers_block_type` entry is `"linear_attention"` run a Mamba-2 mixer (`mamba`; the block keeps
`self_attn = None` there, so attnlens cannot name the mixer `self_attn` and serves none of the mixer's values, see
`families/hybrid.py`); the others Granite's attention (scores scaled by `attention_multiplier`, a
rotary embedding only with `position_embedding_type="rope"`). Both add `residual_multiplier` times their output to the
stream. The MLP is `shared_mlp` (renamed `mlp`): `output_linear(activation(a) * b)` with `a, b` the two halves of
`input_linear(x)` (`mlp_arithmetic`): `mlp_activation` is `activation(a)`, `mlp_neurons` what `output_linear` receives.
With experts, the block adds the routed experts' output (`block_sparse_moe`, reading the same norm output) to the shared
MLP's itself, so no module returns the MLP's output and no single activation or neuron tensor exists: those are
unavailable; `mlp_input` is what both receive.

On vLLM (model_executor/models/granitemoehybrid.py) the blocks keep Granite's multipliers and pass the whole residual
stream as `hidden_states`; the `residual` they also pass along is the previous block's midpoint, which the next block
ignores, so `layer_input` is the block's `hidden_states` argument alone. vLLM builds no `self_attn` on the Mamba-2
layers (there the mixer is `mamba`, as on eager, whose values are not served).
"""

from dataclasses import replace

from ..family import MLPArithmetic
from ..locations import ModuleArgument
from ..locations.vllm import batched
from ..parts import identities
from ..parts.mixers import MixerLayers
from .granite import Granite

ROUTED = (
    "the MLP is the routed experts (block_sparse_moe, each activating only its own tokens) plus shared_mlp, "
    "summed in the block itself: no module returns the sum and no [batch, seq, intermediate] tensor covers both; "
    "layer_output - layer_mid is residual_multiplier times it"
)


def _granitemoehybrid_vllm_locations(family):
    # called (positions, hidden_states, residual): the residual is not part of the stream here
    return {**Granite.vllm.locations(family), "layer_input": batched(ModuleArgument("", 1))}


class GraniteMoeHybrid(MixerLayers, Granite):
    model_types = ("granitemoehybrid",)
    tiny = (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {
            **Granite.tiny[2],
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "shared_intermediate_size": 64,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        },
    )
    tiny_layouts = {"dense": {"num_local_experts": 0}}
    mlp = "shared_mlp"
    activation = "activation"
    down_projection = "output_linear"
    mixer_renamed = False  # the block sets self_attn = None on Mamba-2 layers
    # vLLM's head size is hidden_size // num_attention_heads (32 and up on CPU), its Mamba-2 inner size
    # mamba_expand * hidden_size; the last layer has a pattern (tests_vllm reads it), a Mamba-2 layer between two
    # attention layers passes them a residual they must ignore.
    vllm = replace(
        Granite.vllm,
        model_types=("granitemoehybrid",),
        tiny={
            "hidden_size": 128,
            "mamba_d_head": 32,
            "layer_types": ["full_attention", "linear_attention", "full_attention"],
        },
        locations=_granitemoehybrid_vllm_locations,
    )
    mixer_kind = (
        "a Mamba-2 layer: a selective state-space scan over a recurrent state, gated and RMS-normalised before out_proj"
    )

    def is_mixer_layer(self, config, layer):
        return config.layers_block_type[layer] == "linear_attention"

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"routed"} if config.num_local_experts else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "routed" not in kind:
            return locations
        dropped = ("mlp_activation", "mlp_neurons", "mlp_output")
        return {name: location for name, location in locations.items() if name not in dropped}

    class Identities(identities.Identities):
        def mlp_arithmetic(self, mlp):
            def halves(x):
                return mlp.input_linear(x).chunk(2, dim=-1)

            return MLPArithmetic(
                lambda neurons: mlp.output_linear(neurons),
                lambda x: halves(x)[0],
                lambda z: mlp.activation(z),
                lambda x, activation: activation * halves(x)[1],
                says=(
                    "first half of input_linear(mlp input)",
                    "activation * second half of input_linear(mlp input)",
                    "output_linear(neurons)",
                ),
            )

    kind_reasons = {"routed": dict.fromkeys(("mlp_activation", "mlp_neurons", "mlp_output"), ROUTED)}

    kind_notes = {
        "mixer": {"layer_mid": "layer_input + residual_multiplier ({config.residual_multiplier:g}) * mamba's output"},
        "routed": {"mlp_input": "what shared_mlp and the routed experts (block_sparse_moe) both receive"},
        "!routed": {
            "mlp_activation": "activation(a), a the first half of input_linear(x)",
            "mlp_neurons": "what output_linear receives: activation(a) * b, the halves of input_linear(x)",
        },
    }
