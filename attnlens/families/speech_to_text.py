"""Speech2Text (S2T): a convolutional subsampler over filterbank frames, then mBART's pre-norm blocks in both stacks.

The encoder reads `input_features` `[batch, frames, features]`: `conv` (`Conv1dSubsampler`, two `Conv1d` of stride 2,
each followed by a GLU over channels) turns each four frames into one position (40 ms at the feature extractor's
10 ms hop), scaled by sqrt(d_model), then sinusoidal positions are added. The blocks are mBART's (`PreNormEncoder`,
`PreNormDecoder`: the BERT eager attention function through the shared interface, scaling in the call), with a final
norm on each stack; the decoder's text blocks cross-attend to the audio positions.
"""

from __future__ import annotations

from ..family import EncoderDecoder, Tiny
from .bart import TINY, PreNormDecoder, PreNormEncoder


class Speech2TextEncoder(PreNormEncoder):
    """S2T's audio encoder: the convolutional subsampler (four frames a position), then pre-norm BART blocks."""

    embed_tokens = "conv"

    kind_notes = {
        "*": {
            "embeddings": "conv's output [batch, position, hidden]: the frames subsampled by two Conv1d of stride 2 "
            "(each with a GLU; one position per four frames), before the sqrt(d_model) scale and the sinusoidal "
            "positions",
        }
    }


class Speech2TextDecoder(PreNormDecoder):
    """S2T's text decoder: mBART's pre-norm decoder blocks, cross-attending to the audio positions."""

    kind_notes = {
        "*": {
            "embeddings": "the token embedding's output, before the sqrt(d_model) scale (scale_embedding) and the "
            "sinusoidal positions are applied",
        }
    }


class Speech2Text(EncoderDecoder):
    """Speech2Text: filterbank frames (`input_features`) subsampled by convolutions into audio positions, mBART's
    pre-norm blocks over them, and a text decoder of pre-norm blocks cross-attending to them."""

    model_types = ("speech_to_text",)
    encoder = Speech2TextEncoder
    decoder = Speech2TextDecoder
    #: `input_features` is [batch, frames, features]: time is its second axis (`StandardizedSeq2Seq.positions`).
    time_axis = 1
    tiny = Tiny(
        "Speech2TextConfig",
        "Speech2TextForConditionalGeneration",
        {
            **TINY,
            "input_feat_per_channel": 16,
            "input_channels": 1,
            "conv_channels": 32,
            "conv_kernel_sizes": [5, 5],
            "max_source_positions": 64,
            "max_target_positions": 64,
        },
    )
