"""LayoutLM: BERT with 2-D positions. `LayoutLMEmbeddings` adds to the word, position and token-type embeddings the
embeddings of each token's bounding box (`bbox`, `[batch, seq, 4]`: x0, y0, x1, y1 in 0..1000; its left, upper,
right and lower edges, its height and its width, from four tables), then normalises; the blocks are BERT's (`bert.py`,
`bert_shaped`), their attention on the shared attention interface. Without `bbox` transformers uses zeros (every token
the box at the origin). The box enters the embeddings only: it changes the values, never how the attention is wired.

LayoutLM has no causal LM in transformers: it is served as an encoder (`StandardizedEncoder`), bidirectional whatever
`is_decoder` says (LayoutLMModel builds its mask from the padding alone).

`encoder_only` makes a `bert_shaped` family (or one built as BERT is) an encoder-only family: the other BERT-like
encoders without a causal LM (`bert_inline.py`, `convbert.py`, `mobilebert.py`, `ibert.py`) use it too.
"""

from __future__ import annotations

from ..family import Tiny, VLLMLayout
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts import scoring
from .bert import bert_shaped

ENCODER_ONLY_VLLM = (
    "{name} has no causal LM in transformers and attnlens serves it as an encoder (StandardizedEncoder), which "
    "attnlens's vLLM backend does not run; the transformers engine serves the family"
)
NO_CACHE = (
    "{name} is an encoder: its model takes no cache and keeps none, so every forward recomputes the keys and values"
)


class Bidirectional(scoring.ScoreFunction):
    """An encoder's score function: every query sees every key that is not padding, whatever the config says."""

    def causal(self, config):
        return False


def encoder_only(
    parent: type, name: str, masked_lm: str, module: str, doc: str, kwargs: dict | None = None, **members
) -> type:
    """`parent` (a BERT-like family) as an encoder-only family `name` of `module`: its tiny recipe the masked LM
    `masked_lm` with `kwargs`, bidirectional, no cache, vLLM refused; `members` added (a table of notes)."""
    reasons = {"*": dict.fromkeys(CACHE_VALUES, NO_CACHE.format(name=name))}
    return type(
        name,
        (parent,),
        {
            "__doc__": doc,
            "__module__": module,
            "model_types": parent.model_types,
            "tiny": Tiny(parent.tiny.config, masked_lm, kwargs or {}),
            "ScoreFunction": Bidirectional,
            "vllm": VLLMLayout(refusal=ENCODER_ONLY_VLLM.format(name=name)),
            "kind_reasons": reasons,
            **members,
        },
    )


LayoutLM = encoder_only(
    bert_shaped("LayoutLM", "layoutlm", "layoutlm", "LayoutLMConfig", "LayoutLMForMaskedLM", "LayoutLM"),
    "LayoutLM",
    "LayoutLMForMaskedLM",
    __name__,
    "LayoutLM: BERT's blocks after embeddings that add each token's bounding box (`bbox`).",
    kind_notes={
        "*": {
            "layer_input": lambda family, config, layer: (
                "LayerNorm(word + position + token type + the bounding box's embeddings: its left, upper, right and "
                "lower edges, height and width; bbox zeros where not given): LayoutLMEmbeddings' output"
                if layer == 0
                else None
            ),
            "attention_probabilities": "bidirectional: every query sees every key that is not padding (LayoutLM "
            "has no decoder: is_decoder is not read)",
        }
    },
)
