"""ConvBERT: BERT's post-norm blocks whose `attention.self` mixes two kinds of heads. Half of the hidden size goes to
attention heads, `num_attention_heads // head_ratio` of them (1 where that is 0), each `hidden_size //
num_heads // 2` wide: BERT's attention, computed inline (`(queries @ keys^T) / sqrt(head_dim)`, the mask, softmax).
The other half is a span-based dynamic convolution of the same width: `conv_out_layer(x)` mixed over a window of
`conv_kernel_size` positions by weights computed per position (`conv_kernel_layer` of the query times a separable
convolution of the block input, softmaxed over the window). `attention.self` concatenates the attention heads' outputs
and the convolution's outputs along the heads (`[batch, seq, 2 * heads, head_dim]`: the attention heads first),
flattens them, and `attention.output.dense` projects both.

attnlens serves the attention heads (queries, keys, values, scores, pattern, head outputs: `heads.num_heads` is the
attention heads' count) and the attention sublayer's output; the convolution half has no query-by-key pattern and is
no value of the vocabulary, and the premix (what `output.dense` receives) holds it beside the attention heads, so the
premix is not served (`kind_reasons`). The rest of the block is BERT's (`bert.py`); with `embedding_size !=
hidden_size` ConvBERT projects the embeddings (`embeddings_project`) before the first block, as ELECTRA does. ConvBERT
has no causal LM in transformers: it is served as an encoder.
"""

from __future__ import annotations

from ..locations import ModuleOutput, Operation
from .bert import encoder_only
from .bert_inline import InlineBert, inline_bert

CONV_HALF = (
    "ConvBERT's output projection (attention.output.dense) reads the attention heads' outputs concatenated with its "
    "span-based dynamic convolution's outputs (the other half of the hidden size, computed from the block input by "
    "conv_out_layer and per-position kernels, with no query-by-key pattern): that concatenation is no merge of the "
    "attention heads alone, and the convolution half is no value of the vocabulary, so attnlens serves the head "
    "outputs and the attention output but not the premix"
)


class _ConvBertLocations(InlineBert):
    block_tuple = False

    def locations(self):
        inner = dict(module="self")
        found = {
            **super().locations(),
            "attention_queries": Operation(("query_layer_0",), anchor="transpose", **inner),
            "attention_keys": Operation(("key_layer_0",), anchor="transpose", **inner),
            "attention_values": Operation(("value_layer_0",), anchor="transpose", **inner),
            "attention_scores": Operation(("nn_functional_softmax_0",), "arg", 0, anchor="softmax(attention", **inner),
            "attention_probabilities": Operation(("attention_probs_1",), anchor="dropout", **inner),
            "attention_head_outputs": Operation(("context_layer_1",), anchor="permute", **inner),
            "attention_output": ModuleOutput(self.output_projection),
        }
        found.pop("attention_premix")
        # forward order: the values are read before the scores (ConvBERT projects them first)
        order = ["attention_queries", "attention_keys", "attention_values", "attention_scores"]
        names = list(found)
        start = names.index("attention_queries")
        rest = [name for name in names[start:] if name not in order]
        return {name: found[name] for name in [*names[:start], *order, *rest]}

    kind_reasons = {"*": {"attention_premix": CONV_HALF}}
    kind_notes = {
        "*": {
            "attention_queries": "the attention heads' only: num_attention_heads // head_ratio heads, each "
            "hidden_size // heads // 2 wide (the convolution takes the other half of the hidden size)",
            "attention_head_outputs": "the attention heads' outputs; attention.self concatenates them with the "
            "convolution's outputs (as many heads of the same width, after them) before output.dense",
            "attention_output": "attention.output.dense's output: the projection of the attention heads' outputs "
            "and the span-based dynamic convolution's outputs together (the convolution's share is not separable "
            "from the values served)",
            "embeddings": "the word embeddings' output, config.embedding_size wide: ConvBERT adds the positions and "
            "token types, normalises, and projects the sum to hidden_size (embeddings_project) where the widths "
            "differ",
        }
    }


ConvBert = encoder_only(
    inline_bert(
        "ConvBert", "convbert", "convbert", "ConvBertConfig", "ConvBertForMaskedLM", "ConvBERT", _ConvBertLocations
    ),
    "ConvBert",
    "ConvBertForMaskedLM",
    __name__,
    "ConvBERT: BERT's blocks, the attention's heads beside a span-based dynamic convolution of the same width.",
    {"embedding_size": 32},
)
