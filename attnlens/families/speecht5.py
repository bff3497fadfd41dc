"""SpeechT5, speech to text (`SpeechT5ForSpeechToText`): a speech encoder over the raw waveform and a text decoder, both
of post-norm blocks (BART's order: each sublayer's output added to the stream, then normalised).

- The encoder (`speecht5.encoder`, its blocks `wrapped_encoder.layers`) reads `input_values` [batch, samples]: its
  prenet (wav2vec 2.0's feature encoder, convolutions over the samples, projected to the hidden size, plus a
  convolutional and a sinusoidal position embedding) gives one position per convolution stride (320 samples, 20 ms
  at 16 kHz, in the released sizes); `wrapped_encoder.layer_norm` normalises that input before the first block (the
  stack has no final norm). Each block's attention (`attention`, renamed `self_attn`) adds a relative position term
  to its scores (Shaw et al.): each query (already scaled) against a learned embedding of each key's distance from it
  (`wrapped_encoder.embed_positions.pe_k`, distances clamped to +-`encoder_max_relative_position`), `[batch, heads,
  query, key]`: served as `attention_position_bias`, editable (what the scores add). Then `layer_norm`, the
  feed-forward (`feed_forward`: `intermediate_dense`, `intermediate_act_fn`, `output_dense`) and `final_layer_norm`.
- The decoder (`speecht5.decoder`, its blocks `wrapped_decoder.layers`) is BART's post-norm decoder block with the
  same feed-forward: `self_attn`, `self_attn_layer_norm`, `encoder_attn` (the cross-attention),
  `encoder_attn_layer_norm`, `feed_forward`, `final_layer_norm`; its prenet embeds the tokens and adds sinusoidal
  positions; no final norm; the logits are `text_decoder_postnet`'s.

The attention is computed inline (no attention interface), the heads folded into the batch (`[batch * heads, ...]`):
the queries, keys, values, position bias, scores and pattern are views of those tensors as `[batch, heads, ...]`.
The queries are scaled as they are projected (`q_proj(x) * head_dim ** -0.5`), so `heads.scale` is 1.0.
"""

from __future__ import annotations

import torch

from ..family import EncoderDecoder, Tiny
from ..locations import Derived, ModuleInput, ModuleOutput, Operation
from ..parts import identities, scoring
from ..parts.eager import EagerFunction
from ..parts.sizes import Sizes, same_as
from .bart import BartDecoder, BartEncoder

POST_NORM = "SpeechT5 normalises after each residual add, not before a sublayer: {what}"
NO_FINAL_NORM = "SpeechT5's decoder has no final norm: the last block's output ends in its own final_layer_norm"
BIAS = "SpeechT5's relative position term (attention_position_bias): each query against its keys' distance embeddings"


def _unfold(envoy, folded):
    """`[batch * heads, ...]` -> `[batch, heads, ...]`, a view (in-place edits land)."""
    heads = envoy._module.num_heads
    return folded.view(folded.shape[0] // heads, heads, *folded.shape[1:])


def _fold(envoy, old, new):
    return new.reshape(old.shape)


def folded(name: str, operation: str, anchor: str, part: str = "output", item: int | None = None) -> Derived:
    """The value `name` held folded at `operation` (its output, or argument `item`), seen as `[batch, heads, ...]`."""
    return Derived(Operation((operation,), part, item, anchor=anchor), _unfold, _fold, name)


class SpeechT5Attention:
    """Mixin, before a BART stack: SpeechT5's inline attention (heads folded into the batch), and its feed-forward
    module."""

    eager = EagerFunction(only=())  # computed inline: one path whatever attn_implementation says
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=(same_as("num_heads"),), scale=(1.0,))
    mlp = "feed_forward"
    activation = "intermediate_act_fn"
    down_projection = "output_dense"

    def attention_locations(self, prefix: str = "") -> dict:
        found = {
            f"{prefix}attention_queries": folded("attention_queries", "query_states_2", "reshape(*proj_shape)"),
            f"{prefix}attention_keys": folded("attention_keys", "key_states_3", "reshape(*proj_shape)"),
            f"{prefix}attention_values": folded("attention_values", "value_states_3", "reshape(*proj_shape)"),
            f"{prefix}attention_position_bias": folded("attention_position_bias", "rel_pos_bias_1", "view("),
            f"{prefix}attention_scores": folded(
                "attention_scores", "nn_functional_softmax_0", "softmax(attn_weights", part="arg", item=0
            ),
            f"{prefix}attention_probabilities": folded("attention_probabilities", "attn_probs_0", "dropout("),
            f"{prefix}attention_head_outputs": Operation(("attn_output_2",), anchor="transpose(1, 2)"),
            f"{prefix}attention_premix": ModuleInput(self.output_projection),  # type: ignore[attr-defined]
            f"{prefix}attention_output": ModuleOutput("", 0),
        }
        if prefix or not self.position_bias:  # only the encoder's self-attention is given the relative embeddings
            found.pop(f"{prefix}attention_position_bias")
        return found

    #: Whether the stack's self-attention adds the relative position term (the encoder's).
    position_bias = False

    def locations(self):
        return {
            **super().locations(),  # type: ignore[misc]
            "mlp_input": ModuleInput(self.mlp),
            "mlp_activation": ModuleOutput(self.activation),
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(),
            "layer_output": ModuleOutput("", 0),  # the block returns (output, patterns...)
        }

    class Identities(identities.Identities):
        def mlp_module(self, block):
            return block.feed_forward

        def mlp_forward(self, mlp, mlp_input, **arguments):
            return mlp(mlp_input)

    kind_notes = {
        "*": {
            "attention_queries": "pre-scaled: q_proj(x) * head_dim ** -0.5 (heads.scale is 1.0); a view of the "
            "[batch * heads, query, head_dim] tensor the attention computes with",
            "attention_keys": "a view of the [batch * heads, key, head_dim] tensor (after any cache update)",
            "attention_values": "a view of the [batch * heads, key, head_dim] tensor (after any cache update)",
            "attention_probabilities": "a view of the [batch * heads, query, key] pattern the values are mixed by",
            "mlp_activation": "feed_forward.intermediate_act_fn(intermediate_dense(x)), what output_dense receives "
            "(no gate: the same tensor as mlp_neurons)",
        }
    }


class SpeechT5Encoder(SpeechT5Attention, BartEncoder):
    """SpeechT5's speech encoder: the waveform's prenet, a norm, then post-norm blocks whose attention adds a relative
    position term."""

    layers = "wrapped_encoder.layers"
    embed_tokens = "prenet"
    attention = "attention"
    mlp_norm = "layer_norm"
    position_bias = True

    def locations(self):
        return {**super().locations(), "embeddings": ModuleOutput(self.embed_tokens, 0)}

    class ScoreFunction(scoring.Bidirectional):
        def score_bias(self, config, layer):
            return BIAS

    class Identities(identities.Identities):
        def score_bias_value(self, module, values, layer):
            return values["attention_position_bias"]

        def layer_position_bias(self, root, module, values, num_queries, num_keys):
            """Each (scaled) query against the distance embedding of each key (`pe_k`, distances clamped), from the
            encoder's own relative embedding module."""
            queries = values["attention_queries"]
            embeddings = root.wrapped_encoder.embed_positions(queries.new_zeros(1, num_keys, 1))
            return torch.einsum("bhqd,qkd->bhqk", queries, embeddings[-num_queries:])

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(what="the attention reads the block input itself"),
            "final_norm_output": "SpeechT5's encoder normalises its input (wrapped_encoder.layer_norm, before "
            "layers[0]), not its output: the last block's output ends in its own final_layer_norm",
        }
    }
    kind_notes = {
        "*": {
            "embeddings": "the speech prenet's output [batch, position, hidden]: the waveform's convolutions projected "
            "to the hidden size, plus the convolutional and sinusoidal position embeddings; wrapped_encoder.layer_norm "
            "of it is layers[0].layer_input",
            "attention_position_bias": "[batch, heads, query, key]: each scaled query against the learned embedding "
            "of each key's distance from it (pe_k, clamped to +-encoder_max_relative_position); a view of the term "
            "the attention adds to its scores",
            "attention_scores": "queries @ keys^T (queries pre-scaled) + attention_position_bias, plus the mask where "
            "the model built one (padding): what the softmax receives",
            "layer_mid": "layer_input + attention_output, what layer_norm receives (post-norm)",
            "mlp_norm_output": "layer_norm(layer_mid): the feed-forward's input and the stream its output joins",
            "layer_output": "final_layer_norm(mlp_norm_output + mlp_output): post-norm",
        }
    }


class SpeechT5Decoder(SpeechT5Attention, BartDecoder):
    """SpeechT5's text decoder: BART's post-norm decoder blocks with SpeechT5's attention and feed-forward."""

    layers = "wrapped_decoder.layers"
    embed_tokens = "prenet.embed_tokens"

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(what="the attention reads the block input itself"),
            "cross_attention_norm_output": POST_NORM.format(what="the cross-attention reads the stream itself"),
            "final_norm_output": NO_FINAL_NORM,
        }
    }

    kind_notes = {
        "*": {
            "embeddings": "the token embedding's output, before the prenet scales it (scale_embedding) and adds the "
            "sinusoidal positions",
            "attention_scores": "queries @ keys^T (queries pre-scaled) + the causal mask",
        }
    }


class SpeechT5(EncoderDecoder):
    """SpeechT5, speech to text: a waveform encoder with relative position terms, a text decoder, post-norm blocks."""

    model_types = ("speecht5",)
    encoder = SpeechT5Encoder
    decoder = SpeechT5Decoder
    stacks = {"encoder": "speecht5.encoder", "decoder": "speecht5.decoder"}
    #: positions(): the waveform's 16 kHz samples, stepped over by the feature encoder's convolutions (not the
    #: prenet's positional convolution, which keeps the count)
    hop_seconds = 1 / 16000
    time_convolutions = "prenet.feature_encoder"
    tiny = Tiny(
        "SpeechT5Config",
        "SpeechT5ForSpeechToText",
        dict(
            hidden_size=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            vocab_size=128,
            initializer_range=0.2,  # wide: patterns far from uniform, the relative term large enough to move them
            feat_extract_norm="layer",  # a LayerNorm per position (the released "group" norms the first conv over time)
            conv_dim=[16, 16],
            conv_stride=[5, 2],
            conv_kernel=[10, 3],
            num_feat_extract_layers=2,
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            encoder_max_relative_position=8,  # shorter than the tiny input: far distances share a clamped row
            max_speech_positions=128,
            max_text_positions=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
    )
