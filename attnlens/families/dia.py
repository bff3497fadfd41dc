"""Dia (`DiaForConditionalGeneration`), a text-to-speech encoder-decoder, recorded as refused: its text encoder is
Llama-like, but its decoder reads and predicts audio codebooks rather than one token per position."""

from __future__ import annotations

from ..family import EncoderDecoder


class Dia(EncoderDecoder):
    """Dia: a byte-level text encoder and a decoder over `num_channels` audio codebooks (9 in the released model)."""

    model_types = ("dia",)
    refused = (
        "Dia's decoder works on audio codebooks, not on one token per position: its decoder_input_ids are [batch, "
        "frames, num_channels] (each channel delayed against the first by config.delay_pattern), summed into one "
        "embedding per frame (DiaMultiChannelEmbedding), and its logits are [batch * num_channels, frames, vocab] "
        "(one head, logits_dense, for every channel); attnlens's decoder inputs, logits and the analyses on them (a "
        "target token's logit, generate's steps) take one token per decoder position, so Dia is not served yet"
    )
