"""Cohere (Command-R): a parallel block like Phi's, interleaved rotary embedding, optional per-head QK LayerNorm, and
logits multiplied by `config.logit_scale`.

Attention and the MLP read the same `input_layernorm` output and their outputs join the block input in one sum, so
`layer_mid` is unavailable and `mlp_norm_output` is the shared norm output as the MLP receives it. The rotary
embedding rotates adjacent pairs of dimensions (not halves); with `use_qk_norm` a LayerNorm over each head's queries
and keys runs before it, and the queries and keys are read after both. `logits` are what the caller receives: the
language-model head's output times `logit_scale`.
"""

from ..family import Family
from ..locations import ModuleInput
from .phi import PARALLEL_NO_MID, parallel_locations, shared_norm_note


class Cohere(Family):
    model_types = ("cohere",)
    tiny = ("CohereConfig", "CohereForCausalLM", {})
    tiny_layouts = {"qk_norm": {"use_qk_norm": True}}
    absent = {"layer_mid": PARALLEL_NO_MID.format(norms="one shared input_layernorm")}

    def locations(self):
        return parallel_locations(super().locations(), ModuleInput(self.mlp))

    def notes(self, config, layer, engine="eager"):
        return {**super().notes(config, layer, engine), "mlp_norm_output": shared_norm_note(self.attention_norm),
                "logits": f"the language-model head's output times config.logit_scale ({config.logit_scale})"}
