"""X-MOD: RoBERTa with a language adapter in every block. `XmodLayer` runs BERT's post-norm attention (`bert.py`: the
attention on the shared attention interface, `attention.output` adding the residual, `attention.output.LayerNorm`
after it, called by `XmodAttention`), then the MLP (`intermediate`, `output.dense`); `XmodOutput` adds the residual
and runs the adapter of each row's language (`lang_adapter`: `output.LayerNorm` of the sum, with
`adapter_reuse_layer_norm`, then `adapter_modules[language]` (down-projection, activation, up-projection) plus that
normalised sum as its residual), and the block ends in `output.LayerNorm` again. The language of each row is
`lang_ids` (`[batch]`, an index into `config.languages`), else `config.default_language` for every row: X-MOD
refuses to run without one. The tiny recipe sets `default_language` to its one language.

The adapter sits inside `layer_output` (between `mlp_output` and the block's last norm): no value of the vocabulary
holds it, and the identities recompute it with the block's own adapters from `lang_ids`, read from the block's call
(`Identities.block_arguments`). `config.pre_norm=True` (a norm before each sublayer, one after the last block) is
refused with the reason (`kind_reasons`); the released X-MOD checkpoints are post-norm.
"""

from __future__ import annotations

from ..family import Tiny, VLLMLayout
from ..parts import identities
from ..values import ALL_VALUES
from .bert import ROBERTA_POSITIONS, Bert, bert_shaped

PRE_NORM = (
    "config.pre_norm=True: X-MOD then normalises before each sublayer with the post-norm's own LayerNorm modules "
    "(attention.output.LayerNorm before the attention, output.LayerNorm before the MLP and again before the adapter) "
    "and once after the last block (encoder.LayerNorm); attnlens serves X-MOD's post-norm layout (pre_norm=False, "
    "that of the released checkpoints) and here the block boundaries only"
)
KEPT_PRE_NORM = ("layer_input", "layer_output", "embeddings", "logits")


class Xmod(
    bert_shaped(
        "Xmod",
        "xmod",
        "roberta",
        "XmodConfig",
        "XmodForCausalLM",
        "X-MOD",
    )
):
    """X-MOD: RoBERTa's post-norm blocks with a language adapter after each block's MLP (`lang_ids`)."""

    model_types = ("xmod",)
    vllm = VLLMLayout(
        refusal="attnlens has not compared vLLM's X-MOD with transformers on the same weights (its language "
        "adapters take lang_ids beside the tokens); the transformers engine serves the family"
    )
    tiny = Tiny("XmodConfig", "XmodForCausalLM", {**Bert.tiny.kwargs, "default_language": "en_XX"})
    padding_changes_values = ROBERTA_POSITIONS

    def layer_kind(self, config, layer):
        return frozenset({"pre_norm"}) if getattr(config, "pre_norm", False) else frozenset()

    def kind_locations(self, kind, config, engine):
        found = super().kind_locations(kind, config, engine)
        if "pre_norm" in kind:
            found = {name: where for name, where in found.items() if name in KEPT_PRE_NORM}
        return found

    class Identities(identities.Identities):
        block_arguments = {"lang_ids": 1}  # XmodLayer(hidden_states, lang_ids, attention_mask, ...)

        def residual_add(self, block, sublayer, stream, update, lang_ids=None, **arguments):
            """Post-norm: the attention's update joins the block input before `attention.output.LayerNorm`; the
            MLP's joins the normalised stream, the language adapter (`output.lang_adapter`, by `lang_ids`) runs on
            their sum, and `output.LayerNorm` ends the block."""
            if sublayer == "attention":
                return stream + update
            summed = block.attention.output.LayerNorm(stream) + update
            return block.output.LayerNorm(block.output.lang_adapter(lang_ids, summed))

    kind_reasons = {
        "pre_norm": {value.name: PRE_NORM for value in ALL_VALUES if value.name not in KEPT_PRE_NORM},
    }
    kind_notes = {
        "*": {
            "layer_output": "output.LayerNorm(lang_adapter(mlp_norm_output + mlp_output)): the language adapter of "
            "each row's language (lang_ids, else config.default_language) runs inside it, after the MLP's residual "
            "add: output.LayerNorm(sum), adapter_modules[language] of that plus it, then output.LayerNorm again",
            "mlp_output": "output.dense's output, before the residual add and the language adapter",
            "layer_mid": "layer_input + attention_output, what attention.output.LayerNorm receives (post-norm; "
            "XmodAttention calls it after attention.output adds the residual)",
        }
    }
