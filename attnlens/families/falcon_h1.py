"""Falcon-H1: attention and a Mamba-2 mixer side by side in every block, and muP multipliers throughout.

Each block normalises its input once (`input_layernorm`); the Mamba-2 mixer (`mamba`) reads that output, the attention
reads it times `attention_in_multiplier`, and the block adds `ssm_out_multiplier * mamba + attention_out_multiplier *
attention` to its input: `layer_mid` (what `pre_ff_layernorm` receives) is that sum, so it holds the Mamba branch too
(`residual_add` recomputes it for the identities). The keys are `k_proj`'s output times `key_multiplier`, then rotated;
`attention_output` is the attention module's output, before `attention_out_multiplier`. The MLP (`feed_forward`) is
`down_proj(up_proj(x) * act(gate_proj(x) * gate_multiplier)) * down_multiplier` (`config.mlp_multipliers`;
`mlp_arithmetic`): `mlp_activation` is `act`'s output, `mlp_neurons` what `down_proj` receives, `mlp_output` the MLP's
output, after the multiplier. The first block receives the embeddings times `embedding_multiplier`; `logits` are the LM
head's output times `lm_head_multiplier`.

vLLM's Falcon-H1 (model_executor/models/falcon_h1.py) keeps these module names and passes the residual stream between
blocks as one tensor; its attention module (`self_attn`) returns `(output, residual)`, and its MLP fuses the gate and
up projections (so `mlp_activation` is never formed alone).
"""

from ..family import Family, MLPArithmetic, VLLMLayout
from ..locations import Derived, ModuleInput, ModuleOutput
from ..parts import identities


def _falconh1_vllm_locations(family):
    from ..locations import ModuleArgument
    from ..locations.views import copy_with_batch, drop_batch
    from ..locations.vllm import batched, copied

    locations = Family.vllm.locations(family)
    embeddings = Derived(
        ModuleOutput(family.embed_tokens),
        copy_with_batch,
        drop_batch,
        in_place=False,
        note="a copy of the token embedding's output, before embedding_multiplier",
        why_not="it is a copy; layers[0].layer_input is what the first block receives",
    )
    return {
        **locations,
        "embeddings": embeddings,
        "layer_input": batched(ModuleArgument("", 1)),
        "attention_norm_output": batched(ModuleOutput(family.attention_norm)),
        "attention_output": copied(ModuleOutput("", 0)),  # (output, residual)
        "layer_mid": batched(ModuleInput(family.mlp_norm)),
        "mlp_output": batched(ModuleOutput()),
        "layer_output": batched(ModuleOutput()),
        "final_norm_output": batched(ModuleOutput(family.final_norm)),
    }


class FalconH1(Family):
    model_types = ("falcon_h1",)
    # multipliers away from 1, so a family ignoring one fails the identities
    tiny = (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        {
            "head_dim": 16,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_d_ssm": 128,
            "key_multiplier": 0.5,
            "attention_in_multiplier": 2.0,
            "attention_out_multiplier": 0.5,
            "ssm_out_multiplier": 0.25,
            "embedding_multiplier": 2.0,
            "lm_head_multiplier": 0.5,
            "mlp_multipliers": [2.0, 0.5],
        },
    )
    final_norm = "model.final_layernorm"
    mlp = "feed_forward"
    mlp_norm = "pre_ff_layernorm"
    # vLLM: attention heads of 32 (CPU), Mamba-2 heads as Granite 4's
    vllm = VLLMLayout(
        model_types=("falcon_h1",),
        tiny={"head_dim": 32, "mamba_d_head": 32, "mamba_d_ssm": 256},
        locations=_falconh1_vllm_locations,
    )

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            if sublayer == "mlp":
                return stream + update
            mamba = block.mamba(hidden_states=block.input_layernorm(stream))
            return stream + update * block.attn_out_multiplier + mamba * block.ssm_out_multiplier

        def mlp_arithmetic(self, mlp):
            return MLPArithmetic(
                lambda neurons: mlp.down_proj(neurons) * mlp.down_multiplier,
                lambda x: mlp.gate_proj(x) * mlp.gate_multiplier,
                lambda z: mlp.act_fn(z),
                lambda x, activation: mlp.up_proj(x) * activation,
                says=(
                    "gate(mlp input) * gate_multiplier",
                    "up(mlp input) * activation",
                    "down projection(neurons) * down_multiplier",
                ),
            )

    kind_notes = {
        "*": {
            "attention_norm_output": "input_layernorm's output, read by the Mamba-2 mixer as it is and by the "
            "attention times attention_in_multiplier ({config.attention_in_multiplier:g})",
            "attention_keys": "k_proj's output times key_multiplier ({config.key_multiplier:g}), then rotated",
            "attention_output": "the attention module's output, before attention_out_multiplier "
            "({config.attention_out_multiplier:g})",
            "layer_mid": "layer_input + {config.attention_out_multiplier:g} * attention_output + "
            "{config.ssm_out_multiplier:g} * the Mamba-2 mixer's output (the two run side by side)",
            "mlp_activation": "act(gate_proj(x) * gate_multiplier ({config.mlp_multipliers[0]:g}))",
            "mlp_output": "down_proj(mlp_neurons) * down_multiplier ({config.mlp_multipliers[1]:g})",
            "embeddings": "the token embedding's output; layers[0].layer_input is it times embedding_multiplier "
            "({config.embedding_multiplier:g})",
            "logits": "the LM head's output times lm_head_multiplier ({config.lm_head_multiplier:g})",
        }
    }
