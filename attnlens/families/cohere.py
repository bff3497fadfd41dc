"""Cohere (Command-R): a parallel block like Phi's, interleaved rotary embedding, optional per-head QK LayerNorm, and
logits multiplied by `config.logit_scale`.

Attention and the MLP read the same `input_layernorm` output and their outputs join the block input in one sum, so
`layer_mid` is unavailable and `mlp_norm_output` is the shared norm output as the MLP receives it. The rotary
embedding rotates adjacent pairs of dimensions (not halves); with `use_qk_norm` a LayerNorm over each head's queries
and keys runs before it, and the queries and keys are read after both. `logits` are what the caller receives: the
language-model head's output times `logit_scale`.

vLLM's Cohere blocks receive its `(hidden, residual)` pair but use only `hidden`, the whole residual stream, and return
`(layer output, their own input)`: `layer_input` and `layer_output` are the first items there, not the pair's sum.
"""

from ..family import Family, Tiny, VLLMLayout
from ..locations import ModuleArgument, ModuleInput, ModuleOutput
from ..locations.vllm import batched
from ..parts.parallel import PARALLEL_NO_MID, parallel_locations, shared_attention_norm


def _cohere_vllm_locations(family):
    locations = parallel_locations(Family.vllm.locations(family), batched(ModuleInput(family.mlp)))
    # Nothing overwrites the sublayers' outputs in place here (no fused residual norm): no copies needed.
    return {
        **locations,
        "layer_input": batched(ModuleArgument("", 1)),
        "attention_output": batched(ModuleOutput()),
        "mlp_output": batched(ModuleOutput()),
        "layer_output": batched(ModuleOutput("", 0)),
    }


class Cohere(Family):
    model_types = ("cohere",)
    tiny = Tiny("CohereConfig", "CohereForCausalLM", {}, layouts={"qk_norm": {"use_qk_norm": True}})
    absent = {"layer_mid": PARALLEL_NO_MID.format(norms="one shared input_layernorm")}
    vllm = VLLMLayout(
        locations=_cohere_vllm_locations,
        model_types=("cohere",),
        tiny={"head_dim": 32, "use_qk_norm": True},  # the harder layout; its locations are the plain one's
    )

    def locations(self):
        return parallel_locations(super().locations(), ModuleInput(self.mlp))

    kind_notes = {
        "*": {
            "mlp_norm_output": shared_attention_norm,
            "logits": "the language-model head's output times config.logit_scale ({config.logit_scale})",
        }
    }
