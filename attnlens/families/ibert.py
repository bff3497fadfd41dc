"""I-BERT: RoBERTa built of quantisation-aware modules. Every module returns its output with a scaling factor
(`(tensor, factor)`); the projections are `QuantLinear`, the softmax `IntSoftmax`, the norms `IntLayerNorm`, the
activation `IntGELU`, and `QuantAct` modules requantise between them (the residual adds are theirs: `ln_input_act(x,
identity=residual)`). With `config.quant_mode=False` (the default) each is plain float arithmetic: the linear layers
are `F.linear`, the softmax `softmax`, the norm LayerNorm's arithmetic, the activation GELU, every `QuantAct` the
identity (or the residual add), and every factor None; the block is BERT's post-norm block (`bert.py`), the attention
computed inline (`(queries @ keys^T) / sqrt(head_dim)`, the mask, `attention.self.softmax`). attnlens serves that
arithmetic, reading item 0 of each module's output.

With `quant_mode=True` the projections, the softmax (a second-order polynomial of the exponent), the GELU and the
norm are integer approximations on quantised tensors: the pattern is not the softmax of the scores, and no identity
of the vocabulary holds, so attnlens serves only the block boundaries (`kind_reasons`). Positions are RoBERTa's,
counted from the input ids past the padding. I-BERT has no causal LM in transformers: it is served as an encoder.
"""

from __future__ import annotations

from ..family import MLPArithmetic
from ..locations import ModuleInput, ModuleOutput, Operation
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts import identities
from ..values import ALL_VALUES
from .bert import ROBERTA_POSITIONS, encoder_only
from .bert_inline import InlineBert, inline_bert

QUANT_MODE = (
    "config.quant_mode=True: I-BERT's modules compute on quantised tensors with integer approximations (IntSoftmax "
    "a polynomial of the exponent, IntGELU, IntLayerNorm), so the pattern is not the softmax of the scores nor the "
    "MLP a GELU; attnlens serves I-BERT's float arithmetic (quant_mode=False) only, and here the block boundaries"
)
KEPT_IN_QUANT_MODE = ("layer_input", "layer_output", "embeddings", "logits")


class _IBertMLP:
    """I-BERT's MLP as the identities call it: `output.dense(intermediate(x))`, item 0 of each (their factors None)."""

    def __init__(self, block):
        self.block, self.dense = block, block.output.dense

    def __call__(self, hidden_states):
        return self.dense(self.block.intermediate(hidden_states, None)[0])[0]


class _IBertLocations(InlineBert):
    block_tuple = True
    padding_changes_values = ROBERTA_POSITIONS

    def locations(self):
        inner = dict(module="self")
        found = {
            "embeddings": ModuleOutput(self.embed_tokens, 0),
            "layer_input": ModuleInput(),
            "attention_queries": Operation(("query_layer_0",), anchor="transpose", **inner),
            "attention_keys": Operation(("key_layer_0",), anchor="transpose", **inner),
            "attention_values": Operation(("value_layer_0",), anchor="transpose", **inner),
            "attention_scores": ModuleInput("self.softmax"),
            "attention_probabilities": Operation(("attention_probs_0",), anchor="dropout", **inner),
            "attention_head_outputs": Operation(("context_layer_1",), anchor="permute", **inner),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput(self.output_projection, 0),
            "layer_mid": ModuleInput(self.mlp_norm),
            "mlp_norm_output": ModuleOutput(self.mlp_norm, 0),
            "mlp_input": ModuleInput("intermediate"),
            "mlp_activation": ModuleInput(),
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(self.down_projection, 0),
            "layer_output": ModuleOutput("", 0),
        }
        return {**found, "logits": super().locations()["logits"]}

    def layer_kind(self, config, layer):
        return frozenset({"quant_mode"}) if getattr(config, "quant_mode", False) else frozenset()

    def kind_locations(self, kind, config, engine):
        found = super().kind_locations(kind, config, engine)
        if "quant_mode" in kind:
            found = {name: where for name, where in found.items() if name in KEPT_IN_QUANT_MODE}
        return found

    class Identities(identities.Identities):
        def project_output(self, module, premix):
            return module.output.dense(premix)[0]

        def mlp_module(self, block):
            return _IBertMLP(block)

        def mlp_arithmetic(self, mlp):
            return MLPArithmetic(
                lambda neurons: mlp.dense(neurons)[0],
                lambda x: mlp.block.intermediate.dense(x)[0],
                lambda z: mlp.block.intermediate.intermediate_act_fn(z)[0],
                lambda x, activation: activation,
                says=("intermediate.dense(mlp input)", "activation", "output.dense(neurons)"),
            )

        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Post-norm, as BERT's: `ln_input_act` adds the residual before each IntLayerNorm (item 0: the float
            norm's output)."""
            if sublayer == "attention":
                return stream + update
            return block.output.LayerNorm(block.attention.output.LayerNorm(stream)[0] + update)[0]

    kind_reasons = {
        "quant_mode": {
            value.name: QUANT_MODE
            for value in ALL_VALUES
            if value.name not in KEPT_IN_QUANT_MODE and value.name not in CACHE_VALUES
        },
    }
    kind_notes = {
        "*": {
            "embeddings": "item 0 of word_embeddings' output (a QuantEmbedding: (embeddings, None) with quant_mode "
            "off)",
            "attention_scores": "(queries @ keys^T) / sqrt(head_dim), plus the mask where the model built one: what "
            "attention.self.softmax (IntSoftmax: softmax with quant_mode off) receives",
            "attention_probabilities": "bidirectional: every query sees every key that is not padding",
            "attention_output": "item 0 of attention.output.dense's output (a QuantLinear: F.linear with quant_mode "
            "off)",
            "layer_mid": "layer_input + attention_output (attention.output.ln_input_act adds them), what "
            "attention.output.LayerNorm receives (post-norm)",
            "mlp_norm_output": "item 0 of attention.output.LayerNorm's output (IntLayerNorm: LayerNorm's arithmetic "
            "with quant_mode off); the QuantActs after it are the identity",
        }
    }


IBert = encoder_only(
    inline_bert("IBert", "ibert", "ibert", "IBertConfig", "IBertForMaskedLM", "I-BERT", _IBertLocations),
    "IBert",
    "IBertForMaskedLM",
    __name__,
    "I-BERT: RoBERTa of quantisation-aware modules, served with quant_mode=False (float arithmetic).",
)
