"""BERT's blocks with the attention computed inline, as BERT did before the shared attention interface: TAPAS,
RemBERT and BigBird (its `original_full` attention). Each `<X>SelfAttention` forms
`(queries @ keys^T) / sqrt(head_dim)`, adds the mask the model built (none on an unpadded encoder batch),
applies the softmax and dropout, and mixes the values;
`<X>SelfOutput` and the MLP are BERT's (`bert.py`: post-norm, `LayerNorm(dense(x) + residual)`).

- TAPAS: BERT over a flattened table. Its token types are seven (`token_type_ids` `[batch, seq, 7]`: segment,
  column, row, previous label, column rank, inverse column rank, numeric relation), each with an embedding table of
  its own, all added to the word and position embeddings; with `reset_position_index_per_cell` the positions restart
  in each cell. Encoder only (no causal LM in transformers).
- RemBERT: input embeddings narrower than the blocks (`input_embedding_size`), projected to `hidden_size` by
  `encoder.embedding_hidden_mapping_in` before the first block; its LM head projects to `output_embedding_size` before
  the vocabulary. A causal LM (`RemBertForCausalLM`, `is_decoder=True`) besides the masked LM.
- BigBird: `original_full` (`config.attention_type`) is BERT's full attention, served here. `block_sparse` attends
  over blocks (global, sliding and random ones, gathered by `BigBirdBlockSparseAttention`'s own arithmetic, padded to
  a multiple of `block_size`) and never forms a query-by-key pattern; on sequences too short for it
  (`<= (5 + 2 * num_random_blocks) * block_size` tokens) transformers swaps every block's attention module for the
  full one in the middle of the forward. attnlens serves the attention only where the config says `original_full`.
"""

from __future__ import annotations

from ..family import EagerFunction, Tiny, VLLMLayout
from ..locations import Derived, ModuleInput, ModuleOutput, Operation, OutputField, softmax_argument
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts.sizes import Sizes
from .bert import Bert, encoder_only


def _keys(envoy, transposed):
    return transposed.transpose(-1, -2)


def _untranspose(envoy, old, new):
    return new.transpose(-1, -2)


class InlineBert(Bert):
    """BERT's family where `attention.self` computes the pattern itself (no attention interface)."""

    eager = EagerFunction(only=())  # one attention path, whatever attn_implementation says
    sizes = Sizes(
        num_heads=("self.num_attention_heads",),
        head_dim=("self.attention_head_size",),
        scale=(lambda module, found: found["head_dim"] ** -0.5,),
    )
    #: Whether the block returns a tuple (its output first) rather than the tensor.
    block_tuple = True

    def locations(self):
        inner = dict(module="self")
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_queries": Operation(("query_layer_0",), anchor="transpose", **inner),
            # the keys as the scores read them (after any cache update), transposed back
            "attention_keys": Derived(
                Operation(("key_layer_transpose_0",), anchor="matmul", **inner), _keys, _untranspose, "attention_keys"
            ),
            "attention_scores": softmax_argument(**inner),
            "attention_probabilities": Operation(("attention_probs_1",), anchor="dropout", **inner),
            "attention_values": Operation(("torch_matmul_1",), "arg", 1, anchor="value_layer", **inner),
            "attention_head_outputs": Operation(("context_layer_1",), anchor="permute", **inner),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput(self.output_projection),
            "layer_mid": ModuleInput(self.mlp_norm),
            "mlp_norm_output": ModuleOutput(self.mlp_norm),
            "mlp_input": ModuleInput("intermediate"),
            "mlp_activation": ModuleInput(),
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(self.down_projection),
            "layer_output": ModuleOutput("", 0 if self.block_tuple else None),
            "logits": OutputField("logits"),
        }

    kind_notes = {
        "*": {
            "attention_scores": "(queries @ keys^T) / sqrt(head_dim), plus the mask where the model built one "
            "(padding; causal on a decoder): what the softmax receives",
            "attention_probabilities": lambda family, config, layer: (
                "causal: is_decoder=True"
                if family.score_function().causal(config)
                else "bidirectional: every query sees every key that is not padding"
            ),
            "attention_keys": "read where the scores take them (the transposed operand of queries @ keys^T, "
            "after any cache update), transposed back",
            "attention_values": "read where the pattern mixes them (after any cache update)",
        }
    }


def inline_bert(name, model_type, base, config, causal_lm, summary, parent=None, **members):
    """An `InlineBert` family (or one of `parent`, a subclass) under `base`, its `<Prefix>Attention` and
    `<Prefix>Output` beside `causal_lm`."""
    return type(
        name,
        (parent or InlineBert,),
        {
            "__doc__": summary,
            "__module__": __name__,
            "model_types": (model_type,),
            "layers": f"{base}.encoder.layer",
            "embed_tokens": f"{base}.embeddings.word_embeddings",
            "tiny": Tiny(config, causal_lm, Bert.tiny.kwargs),
            "kind_reasons": {},
            "vllm": VLLMLayout(
                refusal=f"attnlens has not compared vLLM's {name} with transformers on the same weights; the "
                "transformers engine serves the family"
            ),
            **members,
        },
    )


Tapas = encoder_only(
    inline_bert("Tapas", "tapas", "tapas", "TapasConfig", "TapasForMaskedLM", "TAPAS"),
    "Tapas",
    "TapasForMaskedLM",
    __name__,
    "TAPAS: BERT over a flattened table, seven token types of its own, the attention computed inline.",
    kind_notes={
        "*": {
            "layer_input": lambda family, config, layer: (
                "LayerNorm(word + position + the seven table token types' embeddings: segment, column, row, previous "
                "label, column rank, inverse column rank, numeric relation): TapasEmbeddings' output"
                + (
                    "; positions restart in each cell (reset_position_index_per_cell)"
                    if getattr(config, "reset_position_index_per_cell", False)
                    else ""
                )
                if layer == 0
                else None
            ),
        }
    },
)


RemBert = inline_bert(
    "RemBert",
    "rembert",
    "rembert",
    "RemBertConfig",
    "RemBertForCausalLM",
    "RemBERT: BERT's blocks, input embeddings of their own width projected to hidden_size, the attention inline.",
    tiny=Tiny(
        "RemBertConfig",
        "RemBertForCausalLM",
        {**Bert.tiny.kwargs, "input_embedding_size": 32, "output_embedding_size": 32},
    ),
    kind_notes={
        "*": {
            "embeddings": "the word embeddings' output, config.input_embedding_size wide: RemBERT adds the positions "
            "and token types, normalises, and projects the sum to hidden_size (encoder.embedding_hidden_mapping_in) "
            "before layers[0]",
            "layer_input": lambda family, config, layer: (
                "encoder.embedding_hidden_mapping_in(LayerNorm(word + token type + position embeddings)): the "
                "embeddings projected to hidden_size"
                if layer == 0
                else None
            ),
        }
    },
)

BLOCK_SPARSE = (
    "config.attention_type='block_sparse': BigBirdBlockSparseAttention attends over blocks of block_size tokens "
    "(global, sliding-window and random blocks, gathered by its own arithmetic) and never forms the query-by-key "
    "scores or pattern this value is part of; on sequences of at most (5 + 2 * num_random_blocks) * block_size "
    "tokens transformers swaps in the full attention module mid-forward. Load with attention_type='original_full' "
    "(what BigBird runs on such sequences anyway) to read the attention"
)
SPARSE_VALUES = (
    "attention_queries",
    "attention_keys",
    "attention_values",
    "attention_scores",
    "attention_probabilities",
    "attention_head_outputs",
    *CACHE_VALUES,
)


class BlockSparse:
    """A family mixin for BigBird's attention (BigBird, BigBird-Pegasus's encoder): served where `config.attention_type`
    is `original_full`, its own values refused with `BLOCK_SPARSE` where it is `block_sparse`."""

    def layer_kind(self, config, layer):
        return frozenset({"block_sparse"}) if getattr(config, "attention_type", None) == "block_sparse" else frozenset()

    def kind_locations(self, kind, config, engine):
        found = super().kind_locations(kind, config, engine)  # type: ignore[misc]
        if "block_sparse" in kind:
            found = {name: where for name, where in found.items() if name not in SPARSE_VALUES}
        return found

    kind_reasons = {"block_sparse": dict.fromkeys(SPARSE_VALUES, BLOCK_SPARSE)}


class BigBird(
    BlockSparse,
    inline_bert(
        "BigBird",
        "big_bird",
        "bert",
        "BigBirdConfig",
        "BigBirdForCausalLM",
        "BigBird",
        block_tuple=False,
        tiny=Tiny("BigBirdConfig", "BigBirdForCausalLM", {**Bert.tiny.kwargs, "attention_type": "original_full"}),
    ),
):
    """BigBird: BERT's blocks; its `original_full` attention served, computed inline; `block_sparse` refused."""

    model_types = ("big_bird",)
    vllm = VLLMLayout(
        refusal="attnlens has not compared vLLM's BigBird with transformers on the same weights; the transformers "
        "engine serves the family"
    )

    kind_notes = {
        "*": {
            "attention_probabilities": lambda family, config, layer: (
                "causal: is_decoder=True, attention_type='original_full'"
                if family.score_function().causal(config)
                else "bidirectional, attention_type='original_full': every query sees every key that is not padding"
            ),
        },
        "block_sparse": {
            "attention_premix": "the block-sparse attention's merged head outputs (output.dense's input)",
        },
    }
