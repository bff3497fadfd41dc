"""T5Gemma 2: an encoder of Gemma 3's blocks (with a SigLIP vision tower whose pooled image tokens join the text) and
a decoder whose blocks attend to their own positions and the encoder's in one merged attention. Not served: its
reason is `T5Gemma2.refused`.
"""

from __future__ import annotations

from ..family import EncoderDecoder


class T5Gemma2(EncoderDecoder):
    """T5Gemma 2: a decoder with merged self- and cross-attention; not served."""

    model_types = ("t5gemma2",)
    refused = (
        "T5Gemma 2's decoder blocks have no cross-attention of their own: a merged attention (T5Gemma2MergedAttention) "
        "concatenates the decoder's keys and values with the encoder's and takes one softmax over both, so the "
        "self- and cross-attention share one pattern (each half's rows sum to less than one), one output projection "
        "and one residual add, with no stream between them; attnlens's vocabulary (self_attn and cross_attn each "
        "with a pattern and output of its own, cross_attention_input between them) does not describe it yet, and "
        "its text path runs the same merged decoder"
    )
