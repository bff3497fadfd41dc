"""The speech encoder-decoders whose encoder is Parakeet's FastConformer (Cohere ASR, Canary), recorded as refused:
their decoders are pre-norm transformer blocks, but the encoder's blocks are conformer blocks with a relative-position
attention that attnlens does not reproduce yet."""

from __future__ import annotations

from ..family import EncoderDecoder

FAST_CONFORMER = (
    "its encoder is Parakeet's FastConformer (config.encoder_config, model type parakeet_encoder): each block is two "
    "half-step feed-forwards (each added times 0.5) around a self-attention and a convolution module, then a norm, "
    "not attnlens's attention-then-MLP block; and the self-attention is Transformer-XL's relative-position attention: "
    "the queries plus bias_u against the keys, plus the queries plus bias_v against the projected relative position "
    "embeddings, rel-shifted and handed to the attention function as its mask, a position term attnlens does not "
    "serve or recompute yet"
)


class ParakeetEncoderDecoder(EncoderDecoder):
    """Cohere ASR and Canary: a FastConformer encoder over log-mel frames and a decoder of pre-norm blocks (learned
    positions, a cross-attention over the audio positions)."""

    model_types = ("cohere_asr", "canary")
    refused = FAST_CONFORMER
