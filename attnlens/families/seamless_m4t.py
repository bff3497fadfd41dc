"""SeamlessM4T and SeamlessM4T v2, text to text (`SeamlessM4TForTextToText`): NLLB's pre-norm blocks in a text encoder
and a text decoder (`text_encoder`, `text_decoder`), each block's feed-forward a module of its own (`ffn`: `fc1`, `act`,
`fc2`) behind `ffn_layer_norm`, the decoder's cross-attention `cross_attention` behind `cross_attention_layer_norm`.
The attention is BART's (the BERT eager function through the shared interface, scaling in the call); token embeddings
are scaled by sqrt(hidden_size), sinusoidal positions added; a final norm ends each stack.

The type is in both of transformers' registries: the text-to-text class as the sequence-to-sequence LM, the
speech-to-text class (`SeamlessM4TForSpeechToText`) as the speech one. attnlens serves the text-to-text model, whose
tiny recipe and hub loading it builds; the speech-to-text model's encoder is a conformer (`speech_encoder`: two
half-step feed-forwards, a depthwise convolution module and an attention with Transformer-XL relative positions in
every block, v2's chunked with Shaw's relative keys, then an adapter that pools by convolution and attends again),
which attnlens does not serve: a model of that class is refused with the reason (`refusal`).
"""

from __future__ import annotations

from typing import Any

from ..family import EncoderDecoder, Tiny
from ..locations import ModuleInput, ModuleOutput
from ..parts import identities
from ..parts.eager import EagerFunction
from .bart import TINY, PreNormDecoder, PreNormEncoder

SPEECH_ENCODER = (
    "attnlens serves SeamlessM4T's text-to-text model ({model}ForTextToText); this model's encoder is the speech "
    "encoder, a conformer (two half-step feed-forwards, a depthwise convolution module and self-attention with "
    "{positions} in each block, then an adapter that pools by convolution and attends again), whose blocks attnlens "
    "does not reproduce: load the checkpoint with AutoModelForSeq2SeqLM (attnlens.StandardizedSeq2Seq(name) does)"
)


class SeamlessFeedForward:
    """Mixin, before a pre-norm BART stack: the feed-forward a module of its own (`ffn`), behind `ffn_layer_norm`."""

    mlp = "ffn"
    #: the conformer's eager function (wav2vec2-conformer's), shared with the text blocks: a `+ position_bias` line
    #: (never taken by them) before the mask's
    eager = EagerFunction(scores=("attn_weights_2", "+ attention_mask"), probabilities=("attn_weights_4", "dropout("))
    mlp_norm = "ffn_layer_norm"
    activation = "act"
    down_projection = "fc2"

    def locations(self):
        return {
            **super().locations(),  # type: ignore[misc]
            "mlp_input": ModuleInput(self.mlp),
            "mlp_activation": ModuleOutput(self.activation),
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(),
        }

    class Identities(identities.Identities):
        def mlp_module(self, block):
            return block.ffn

        def mlp_forward(self, mlp, mlp_input, **arguments):
            return mlp(mlp_input)

    kind_notes = {
        "*": {
            "layer_mid": "layer_input + attention_output, what ffn_layer_norm receives",
            "mlp_norm_output": "ffn_layer_norm(layer_mid): the feed-forward's input",
            "mlp_activation": "ffn.act(ffn.fc1(x)), what ffn.fc2 receives (no gate: the same tensor as mlp_neurons)",
            "embeddings": "the scaled token embedding's output (times sqrt(hidden_size) where scale_embedding); the "
            "sinusoidal positions are added before layers[0]",
        }
    }


class SeamlessEncoder(SeamlessFeedForward, PreNormEncoder):
    """SeamlessM4T's text encoder: scaled token embeddings and sinusoidal positions, pre-norm blocks, a final norm."""


class SeamlessDecoder(SeamlessFeedForward, PreNormDecoder):
    """SeamlessM4T's text decoder: pre-norm blocks, the cross-attention `cross_attention` behind its own norm."""

    cross_attention = "cross_attention"
    cross_attention_norm = "cross_attention_layer_norm"

    kind_notes = {
        "*": {
            "layer_mid": "cross_attention_input + cross_attention_output, what ffn_layer_norm receives",
        }
    }


class SeamlessM4T(EncoderDecoder):
    """SeamlessM4T (and v2), text to text: NLLB's pre-norm encoder and decoder over one shared vocabulary."""

    model_types = ("seamless_m4t",)
    encoder = SeamlessEncoder
    decoder = SeamlessDecoder
    stacks = {"encoder": "text_encoder", "decoder": "text_decoder"}
    tiny = Tiny(
        "SeamlessM4TConfig",
        "SeamlessM4TForTextToText",  # not the speech registry's SeamlessM4TForSpeechToText (see the module's notes)
        {
            **TINY,
            "hidden_size": 64,
            "max_position_embeddings": 128,
            # the speech encoder's sizes: unused by the text-to-text model, small for the speech class's refusal
            "speech_encoder_layers": 1,
            "speech_encoder_attention_heads": 4,
            "speech_encoder_intermediate_size": 128,
            "feature_projection_input_dim": 16,
            "num_conv_pos_embeddings": 16,
            "num_conv_pos_embedding_groups": 4,
            "adaptor_kernel_size": 2,
            "adaptor_stride": 2,
            "conv_depthwise_kernel_size": 3,
        },
    )

    #: How the speech encoder's attention places positions (what `refusal` names).
    speech_positions = "relative positions (Transformer-XL's, or rotary, as position_embeddings_type says)"

    def refusal(self, model: Any) -> str | None:
        if hasattr(model, self.stacks["encoder"]):
            return None
        return SPEECH_ENCODER.format(model=self.name, positions=self.speech_positions)


class SeamlessM4Tv2(SeamlessM4T):
    """SeamlessM4T v2, text to text: the same text encoder and decoder as v1's."""

    model_types = ("seamless_m4t_v2",)
    speech_positions = "attention within chunks (speech_encoder_chunk_size) over Shaw's relative position keys"
    tiny = Tiny("SeamlessM4Tv2Config", "SeamlessM4Tv2ForTextToText", SeamlessM4T.tiny.kwargs)
