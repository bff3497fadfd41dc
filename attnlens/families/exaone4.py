"""EXAONE 4: OLMo 2's block (no norm in front of attention or the MLP, RMSNorms after each), per-head QK-norm, and
sliding-window layers from `layer_types` whose full-attention layers have no rotary embedding.

Attention reads the residual stream itself, so `attention_norm_output` and `mlp_norm_output` do not exist; `layer_mid`
is `layer_input + post_attention_layernorm(attention_output)` and is the MLP's input; `layer_output` is
`layer_mid + post_feedforward_layernorm(mlp_output)`. The queries and keys are RMS-normalised per head, then rotated
on sliding-window layers only (with no sliding window at all, on every layer), and read after both.

vLLM's EXAONE 4 blocks receive its `(hidden, residual)` pair but use only `hidden` and return `(layer output,
layer_mid)`: `layer_input` and `layer_output` are the first items there.
"""

from dataclasses import replace

from ..family import Tiny
from ..locations import ModuleArgument, ModuleInput, ModuleOutput
from ..locations.vllm import batched
from .llama import Llama
from .olmo2 import NO_PRE_NORMS


def _exaone4_vllm_locations(family):
    locations = Llama.vllm.locations(family)
    del locations["attention_norm_output"], locations["mlp_norm_output"]
    # Nothing overwrites the sublayers' outputs in place here (no fused residual norm): no copies needed.
    return {
        **locations,
        "layer_input": batched(ModuleArgument("", 1)),
        "attention_output": batched(ModuleOutput()),
        "layer_mid": batched(ModuleInput(family.mlp)),
        "mlp_output": batched(ModuleOutput()),
        "layer_output": batched(ModuleOutput("", 0)),
    }


def _normed(family, config, layer) -> str:
    """Queries' and keys' note: normed, and rotated unless a hybrid's full-attention layer."""
    rotated = (
        getattr(config, "sliding_window", None) is None
        or family.score_function().sliding_window(config, layer) is not None
    )
    return "RMS-normalised per head (q_norm/k_norm over head_dim), then " + (
        "rotated" if rotated else "not rotated: a full-attention layer of a hybrid model has no rotary embedding"
    )


class Exaone4(Llama):
    model_types = ("exaone4",)
    tiny = Tiny(
        "Exaone4Config",
        "Exaone4ForCausalLM",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    )
    attention_norm = None
    mlp_norm = None
    attention_post_norm = "post_attention_layernorm"
    mlp_post_norm = "post_feedforward_layernorm"
    absent = {**Llama.absent, **NO_PRE_NORMS}
    vllm = replace(Llama.vllm, model_types=("exaone4",), locations=_exaone4_vllm_locations)

    def locations(self):
        locations = super().locations()
        del locations["attention_norm_output"], locations["mlp_norm_output"]
        return {**locations, "layer_mid": ModuleInput(self.mlp)}  # the MLP's input: one tensor, two names

    kind_notes = {
        "*": {
            "attention_queries": _normed,
            "attention_keys": _normed,
            "mlp_input": "the same tensor as layer_mid: no norm in front of the MLP",
            "layer_output": "layer_mid + post_feedforward_layernorm(mlp_output): a norm follows the MLP",
        }
    }
