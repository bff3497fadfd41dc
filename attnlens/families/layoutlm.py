"""LayoutLM: BERT with 2-D positions. `LayoutLMEmbeddings` adds to the word, position and token-type embeddings the
embeddings of each token's bounding box (`bbox`, `[batch, seq, 4]`: x0, y0, x1, y1 in 0..1000; its left, upper,
right and lower edges, its height and its width, from four tables), then normalises; the blocks are BERT's (`bert.py`,
`bert_shaped`), their attention on the shared attention interface. Without `bbox` transformers uses zeros (every token
the box at the origin). The box enters the embeddings only: it changes the values, never how the attention is wired.

LayoutLM has no causal LM in transformers: it is served as an encoder (`StandardizedEncoder`), bidirectional whatever
`is_decoder` says (LayoutLMModel builds its mask from the padding alone).

"""

from __future__ import annotations

from .bert import bert_shaped, encoder_only

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
