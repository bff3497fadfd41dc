"""MiniMax (MiniMax-Text-01): lightning-attention layers with softmax-attention layers among them, DeepNorm-style
residuals added to the *normalised* stream, and a mixture of experts in every block.

Each block normalises its input (`input_layernorm`) and adds the attention output to that norm's output, not to the
input: `layer_mid = alpha * input_layernorm(layer_input) + beta * attention_output` (what `post_attention_layernorm`
receives), and likewise `layer_output = alpha' * post_attention_layernorm(layer_mid) + beta' * mlp_output`, with the
config's `full_attn_*`/`linear_attn_*` and `mlp_*` alpha and beta factors (`residual_add`). Layers whose
`config.layer_types` entry is `"linear_attention"` run lightning attention under the same name `self_attn`: linear
attention with a per-head exponential decay, computed block by block over a recurrent key-value state, with no softmax
pattern (see `families/hybrid.py`); the others run the common softmax attention.
"""

from ..family import Family, Tiny, VLLMLayout
from ..parts import identities
from ..parts.mixers import MixerLayers
from ..parts.moe import SparseMoE, moe_absent
from ..parts.vllm import backend_refuses, no_dispatch


class MiniMax(MixerLayers, SparseMoE, Family):
    model_types = ("minimax",)
    vllm = VLLMLayout(
        refusal=backend_refuses(
            "MiniMax",
            no_dispatch("1 (linear_attention)"),
            ("MiniMaxForCausalLM", "0.23.0"),
        )
    )
    tiny = Tiny(
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "block_size": 4,
            "layer_types": ["full_attention", "linear_attention", "full_attention"],
            "full_attn_alpha_factor": 2.0,
            "full_attn_beta_factor": 0.5,
            "linear_attn_alpha_factor": 1.5,
            "linear_attn_beta_factor": 0.75,
            "mlp_alpha_factor": 0.5,
            "mlp_beta_factor": 2.0,
        },
    )
    mixer = "self_attn"  # lightning attention keeps the attention's name
    mixer_kind = (
        "a lightning-attention layer: linear attention with a per-head exponential decay, computed block by "
        "block over a recurrent key-value state, RMS-normalised and gated by sigmoid(output_gate)"
    )
    mixer_premix = (
        "what its out_proj receives is the gated, normalised linear-attention output, not softmax heads merged"
    )
    absent = moe_absent("MiniMaxExperts")

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            if sublayer == "attention":
                return block.input_layernorm(stream) * block.attn_alpha_factor + update * block.attn_beta_factor
            return block.post_attention_layernorm(stream) * block.mlp_alpha_factor + update * block.mlp_beta_factor

    kind_notes = {
        "*": {
            "layer_mid": lambda family, config, layer: (
                f"{family.factor(config, layer, 'alpha'):g} * input_layernorm(layer_input) + "
                f"{family.factor(config, layer, 'beta'):g} * attention_output: the attention adds to the normalised "
                "stream"
            ),
            "layer_output": "{config.mlp_alpha_factor:g} * post_attention_layernorm(layer_mid) + "
            "{config.mlp_beta_factor:g} * mlp_output",
        }
    }

    def factor(self, config, layer, which: str) -> float:
        """The layer's attention residual factor (`which`: "alpha", "beta"), its kind's: linear or full."""
        kind = "linear" if "mixer" in self.layer_kind(config, layer) else "full"
        return getattr(config, f"{kind}_attn_{which}_factor")
