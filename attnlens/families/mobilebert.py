"""MobileBERT: BERT's post-norm blocks run in a bottleneck, with several feed-forward networks per block.

Each `MobileBertLayer` takes the `hidden_size`-wide stream and (with `use_bottleneck`, the default) narrows it:
`bottleneck.input` (dense to `intra_bottleneck_size`, then a norm) gives the stream the attention's residual joins,
and, with `key_query_shared_bottleneck`, `bottleneck.attention` (another such layer) gives what the queries and keys
read, while the values read the block input itself. The attention (`attention.self`, on the shared attention
interface, `true_hidden_size` wide) and `attention.output` (`LayerNorm(dense(heads) + narrowed input)`) are BERT's
post-norm sublayer. Then `num_feedforward_networks - 1` feed-forward networks (`ffn[i]`: `LayerNorm(dense(act(
intermediate(x))) + x)`) and the block's own (`intermediate`, then `output`: `LayerNorm(dense(act) + x)`, and
`output.bottleneck`: `LayerNorm(dense(that) + block input)`, widening back to `hidden_size`). The norms are
`NoNorm` (an elementwise gain and bias) unless `normalization_type="layer_norm"`.

attnlens serves the feed-forward stack as the block's MLP: `mlp_input` is what the first feed-forward network
receives (`attention.output.LayerNorm`'s output), and `mlp_activation`, `mlp_neurons` and `mlp_output` are the last
one's (`intermediate`, `output.dense`); the networks before it, each post-norm with a residual of its own, belong to
the MLP's arithmetic (the identities run them with the block's own modules). `layer_mid` is what
`attention.output.LayerNorm` receives: the attention output plus the *narrowed* block input. These values and the
attention output are `true_hidden_size` wide, not `hidden_size` (the tiny recipe makes the two equal, as the
load-time layout check expects `hidden_size`; the identities hold at any widths). MobileBERT has no causal LM in
transformers: it is served as an encoder.
"""

from __future__ import annotations

from ..family import MLPArithmetic
from ..locations import ModuleInput
from ..parts import identities
from .bert import bert_shaped, encoder_only

WIDTH = "true_hidden_size wide (the bottleneck's width), not hidden_size"


def _stack(block, x):
    """`x` through the block's feed-forward networks before its own (`ffn`, where `num_feedforward_networks > 1`)."""
    for ffn in getattr(block, "ffn", ()):
        x = ffn(x)
    return x


class _FeedForwardStack:
    """The block's MLP as the identities call it: the feed-forward networks before the block's own, then its own
    `output.dense(intermediate(x))` (the residual add, norm and bottleneck of `output` follow it)."""

    def __init__(self, block):
        self.block, self.dense = block, block.output.dense

    def __call__(self, hidden_states):
        return self.dense(self.block.intermediate(_stack(self.block, hidden_states)))


class _MobileBertLocations(
    bert_shaped("MobileBert", "mobilebert", "mobilebert", "MobileBertConfig", "MobileBertForMaskedLM", "MobileBERT")
):
    def layer_kind(self, config, layer):
        return frozenset({"ffn_stack"}) if getattr(config, "num_feedforward_networks", 1) > 1 else frozenset()

    def kind_locations(self, kind, config, engine):
        found = super().kind_locations(kind, config, engine)
        if "ffn_stack" in kind and engine == "transformers":
            found = {**found, "mlp_input": ModuleInput("ffn.0")}  # the first feed-forward network's input
        return found

    class Identities(identities.Identities):
        block_arguments = {"hidden_states": 0}  # the block input: output.bottleneck's residual

        def project_output(self, module, premix):
            return module.output.dense(premix)

        def mlp_module(self, block):
            return _FeedForwardStack(block)

        def mlp_arithmetic(self, mlp):
            block = mlp.block
            return MLPArithmetic(
                lambda neurons: block.output.dense(neurons),
                lambda x: block.intermediate.dense(_stack(block, x)),
                lambda z: block.intermediate.intermediate_act_fn(z),
                lambda x, activation: activation,
                says=("intermediate.dense(the earlier feed-forward networks(mlp input))", "activation", "output.dense"),
            )

        def residual_add(self, block, sublayer, stream, update, hidden_states=None, **arguments):
            """The attention's update joins the narrowed block input (`bottleneck.input`); the MLP's joins the stream
            after `attention.output.LayerNorm` and the earlier feed-forward networks, `output.LayerNorm` follows, and
            `output.bottleneck` widens it back, adding the block input."""
            if sublayer == "attention":
                narrowed = block.bottleneck.input(stream) if block.use_bottleneck else stream
                return narrowed + update
            x = _stack(block, block.attention.output.LayerNorm(stream))
            out = block.output.LayerNorm(update + x)
            return block.output.bottleneck(out, hidden_states) if block.use_bottleneck else out

    kind_notes = {
        "*": {
            "attention_queries": "what bottleneck.attention gives (key_query_shared_bottleneck), through query: "
            "heads of true_hidden_size / num_heads",
            "attention_values": "of the block input itself (use_bottleneck_attention=False) or its narrowing",
            "attention_output": "attention.output.dense's output, " + WIDTH,
            "layer_mid": "bottleneck.input(layer_input) + attention_output: what attention.output.LayerNorm "
            "receives, " + WIDTH,
            "mlp_norm_output": "attention.output.LayerNorm's output (NoNorm: x * weight + bias, by default), " + WIDTH,
            "mlp_input": lambda family, config, layer: (
                "what the first of the block's num_feedforward_networks feed-forward networks (ffn.0) receives: "
                "mlp_norm_output; the activation, neurons and output are the last network's, " + WIDTH
                if getattr(config, "num_feedforward_networks", 1) > 1
                else "what intermediate receives, " + WIDTH
            ),
            "mlp_activation": "the block's own (last) feed-forward network's activation: intermediate's output",
            "mlp_output": "output.dense's output (the last feed-forward network's), " + WIDTH,
            "layer_output": "output.bottleneck(output.LayerNorm(x + mlp_output), layer_input): widened back to "
            "hidden_size, adding the block input (x: the stream after the earlier feed-forward networks)",
            "embeddings": "the word embeddings' output, config.embedding_size wide: MobileBERT concatenates each "
            "token's neighbours' (trigram_input), projects to hidden_size, adds positions and token types, normalises",
            "layer_input": lambda family, config, layer: (
                "NoNorm(embedding_transformation(trigram of word embeddings) + position + token type embeddings)"
                if layer == 0
                else None
            ),
        }
    }


MobileBert = encoder_only(
    _MobileBertLocations,
    "MobileBert",
    "MobileBertForMaskedLM",
    __name__,
    "MobileBERT: BERT's post-norm blocks in a bottleneck, several feed-forward networks per block.",
    {
        "true_hidden_size": 64,
        "intra_bottleneck_size": 64,
        "embedding_size": 32,
        "num_feedforward_networks": 2,
        "initializer_range": 0.05,  # NoNorm does not normalise: wider weights saturate the patterns
    },
)
