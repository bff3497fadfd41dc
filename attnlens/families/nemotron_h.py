"""Nemotron-H: blocks of one sublayer each, Mamba-2, attention, MLP or mixture of experts, behind one norm.

Each block is `layer_input + mixer(norm(layer_input))`, and `config.layers_block_type` says what its `mixer` is.
attnlens names the mixer `self_attn` on attention and Mamba-2 blocks and `mlp` on MLP and MoE blocks (a block has only
the one), and serves on each block the values its one sublayer has:

- `full_attention` blocks: the common attention (grouped heads, no positional encoding), read after `norm`; the
  stream after attention is the block's output, so `layer_mid` is `layer_output`.
- `linear_attention` blocks: a Mamba-2 mixer, with no queries, keys or pattern; `attention_output` is its output and
  `layer_mid` the block's output.
- `mlp` blocks: `down_proj(relu2(up_proj(x)))` after `norm` (`mlp_norm_output`); the stream entering that norm is the
  block input, so `layer_mid` is `layer_input`.
- `moe` blocks: routed non-gated experts plus a shared expert, so no activation or neuron tensor exists.

What a block lacks (the MLP on a mixing block, attention on an MLP block) is unavailable with the reason.

vLLM's Nemotron-H (model_executor/models/nemotron_h.py) keeps `mixer` and `norm` and carries the stream as its
`(hidden, residual)` pair, the norm adding them. Its MoE blocks run only on CUDA, XPU and ROCm (`vllm.cpu_moe_fault`):
the dense layouts are tested on CPU, the MoE blocks' locations are declared for a GPU run to check. vLLM's Mamba-2
clamps the time step to (0, inf) where transformers clamps it below at `time_step_min` (`TIME_STEP`): the tiny
checkpoint sets that near 0, so both compute the same.
"""

from ..family import Family, Joined, VLLMLayout
from ..locations import ModuleInput, ModuleOutput, insert_after
from ..locations.vllm import ResidualPair, batched
from ..parts.mixers import NO_SOFTMAX
from ..parts.moe import PER_EXPERT

MLP_VALUES = ("mlp_norm_output", "mlp_input", "mlp_activation", "mlp_neurons", "mlp_output")
ATTENTION_VALUES = ("attention_norm_output", *NO_SOFTMAX, "attention_output")
#: What vLLM's Mamba-2 computes otherwise (vllm/model_executor/layers/mamba/mamba_mixer2.py: dt_limit=(0, inf)).
TIME_STEP = (
    "vLLM's Mamba-2 clamps the time step to (0, inf), transformers' below at config.time_step_min: a "
    "checkpoint whose softplus time steps fall under time_step_min gets other values here (the tiny one, "
    "with time_step_min=0.001, differs by up to 9e-4 relative)"
)
KINDS = {
    "full_attention": "an attention block",
    "linear_attention": "a Mamba-2 block (a selective state-space scan over a recurrent state, gated and "
    "RMS-normalised before out_proj)",
    "mlp": "an MLP block",
    "moe": "a mixture-of-experts block",
}


def _nemotronh_vllm_locations(family):
    activation = batched(ModuleOutput(family.activation))  # relu2, a module of its own
    return insert_after(Family.vllm.locations(family), "mlp_input", "mlp_activation", activation)


NO_MLP = "it has no MLP (the MLPs are blocks of their own)"
NOT_SOFTMAX = "not softmax attention: it forms no queries, keys or pattern"


def _block(kind: str | None = None, rest: str = ""):
    """A `kind_reasons` template opening with what a block of `kind` is; kind None: a function, for the block type
    the config names."""
    if kind is None:
        return lambda family, config, layer: (
            f"layer {layer} of Nemotron-H is {KINDS.get(k := family.block_type(config, layer), k)}{rest}"
        )
    return f"layer {{layer}} of Nemotron-H is {KINDS[kind]}{rest}"


class NemotronH(Family):
    model_types = ("nemotron_h",)
    tiny = (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 1,
            "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
        },
    )
    embed_tokens = "model.embeddings"
    final_norm = "model.norm_f"
    attention = mlp = "mixer"
    attention_norm = mlp_norm = "norm"
    # vLLM: heads of 32 and up on CPU, and no MoE block there (vllm.cpu_moe_fault); the last block has a pattern
    vllm = VLLMLayout(
        model_types=("nemotron_h",),
        names={"embed_tokens": "model.embed_tokens"},
        tiny={
            "head_dim": 32,
            "mamba_head_dim": 32,
            "layers_block_type": ["linear_attention", "full_attention", "mlp", "full_attention"],
            "time_step_min": 1e-9,
        },  # TIME_STEP
        unavailable={},  # the MLP blocks' activation is a module of its own (relu2, not fused)
        cpu_moe_fault="its MoE blocks (relu^2 experts, is_act_and_mul=False) run on CUDA only: vLLM says "
        "'is_act_and_mul=False is supported only for CUDA, XPU and ROCm'; not testable on CPU",
        locations=_nemotronh_vllm_locations,
    )
    #: What vLLM says on a CPU about the layouts it cannot run there (they are declared all the same).

    def renames(self, engine="transformers"):
        # by the mixer's class: one envoy cannot be both an attention and an MLP
        if engine == "vllm":
            from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
            from vllm.model_executor.models import nemotron_h as nh

            return {
                self.layers: "layers",
                nh.NemotronHAttention: "self_attn",
                MambaMixer2: "self_attn",
                nh.NemotronHMLP: "mlp",
                nh.NemotronHMoE: "mlp",
            }
        from transformers.models.nemotron_h import modeling_nemotron_h as nh

        return {
            self.layers: "layers",
            nh.NemotronHAttention: "self_attn",
            nh.NemotronHMamba2Mixer: "self_attn",
            nh.NemotronHMLP: "mlp",
            nh.NemotronHMoE: "mlp",
        }

    @staticmethod
    def block_type(config, layer) -> str:
        return config.layers_block_type[layer]

    def layer_kind(self, config, layer):
        return frozenset({self.block_type(config, layer)})

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if kind & {"full_attention", "linear_attention"}:
            dropped = MLP_VALUES + (NO_SOFTMAX if "linear_attention" in kind else ())
            # the stream after attention leaves the block
            mid = ModuleOutput("", 0) if engine == "transformers" else ResidualPair("", "output")
        else:
            dropped = ATTENTION_VALUES + (PER_EXPERT if "moe" in kind else ())
            # the stream entering the MLP's norm is the block input
            mid = ModuleInput(self.mlp_norm) if engine == "transformers" else ResidualPair(self.mlp_norm, "input")
        return {
            name: (mid if name == "layer_mid" else location)
            for name, location in locations.items()
            if name not in dropped
        }

    kind_reasons = {
        "full_attention": dict.fromkeys(MLP_VALUES, f"{_block('full_attention')}: {NO_MLP}"),
        "linear_attention": {
            **dict.fromkeys(MLP_VALUES, f"{_block('linear_attention')}: {NO_MLP}"),
            **dict.fromkeys(NO_SOFTMAX, f"{_block('linear_attention')}, {NOT_SOFTMAX}"),
        },
        "!full_attention !linear_attention": dict.fromkeys(
            ATTENTION_VALUES,
            _block(rest=": it has no attention (attention and Mamba-2 layers are blocks of their own)"),
        ),
        "moe": dict.fromkeys(
            PER_EXPERT,
            f"{_block('moe')}: each routed expert applies relu2 to its own tokens inside mlp.experts, and a shared "
            "expert is added, so no [batch, seq, intermediate] tensor exists",
        ),
    }

    kind_notes = {
        "full_attention": {
            "layer_mid": "the block's output: the block runs only its mixer, no MLP",
            "attention_queries": "no positional encoding: nothing is rotated",
            "attention_keys": "no positional encoding: nothing is rotated",
        },
        "linear_attention": {
            "layer_mid": "the block's output: the block runs only its mixer, no MLP",
            "attention_output": f"the mixer's output: {KINDS['linear_attention']}",
        },
        "vllm linear_attention": {"attention_output": Joined(TIME_STEP)},
        "!full_attention !linear_attention": {"layer_mid": "the block's input: the block runs only its MLP"},
        "vllm moe": {"layer_output": "declared, not testable on CPU: {family.vllm.cpu_moe_fault}"},
    }
