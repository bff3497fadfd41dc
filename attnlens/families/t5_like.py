"""Encoder-decoders built as T5 is (t5.py), with one difference each: Switch Transformers' sparse feed-forward
layers, and Pop2Piano's encoder that reads audio features in place of tokens.

Switch Transformers keeps T5's blocks, attention and position bias; every `sparse_step`-th block's feed-forward
(`layer[-1].mlp`, renamed `mlp`) is a `SwitchTransformersSparseMLP`: a top-1 router (`mlp.router.classifier`, a
linear map to one logit per expert, a softmax in float32) sends each token to its best expert, whose output is scaled
by that expert's probability; a token past an expert's capacity (`expert_capacity` tokens per sequence, in order) gets
zeros. The other blocks keep T5's dense `wi`, `act`, `wo`.

Pop2Piano is T5 (gated GELU feed-forward) whose encoder reads `input_features`, the feature extractor's frames, as its
input embeddings (under `generate`, a composer's embedding is prepended to them first, by `mel_conditioner`, outside
the encoder): its `embed_tokens` only embeds the decoder's MIDI tokens.

LongT5 keeps T5's decoder but its encoder attends within blocks (local, or transient-global attention): refused, with
why (`LongT5.refused`).
"""

from __future__ import annotations

from typing import ClassVar

from ..family import EncoderDecoder, Note, Tiny
from ..parts.moe import PER_EXPERT, SparseMoE
from .t5 import T5, T5Decoder, T5Encoder

#: Why a Switch Transformers sparse block has no activation or neurons tensor.
SWITCH_EXPERTS = dict.fromkeys(
    PER_EXPERT,
    "a sparse mixture of experts: no [batch, seq, intermediate] tensor exists. Each expert's act(wi(x)) is formed "
    "per expert, only for the tokens routed to it, inside mlp.experts (SwitchTransformersExperts.forward, one expert "
    "at a time); mlp_output is the chosen expert's output times its router probability (top-1; zeros past the "
    "expert's capacity)",
)


class SwitchSparse(SparseMoE):
    """Switch Transformers' rule for a sparse block (`SwitchTransformersStack`): every `sparse_step`-th block from
    block 1 (all where the step is 1; none where it is 0), the step the stack's own (`encoder_sparse_step` or
    `decoder_sparse_step`)."""

    step = "encoder_sparse_step"
    absent = SWITCH_EXPERTS

    def moe_layer(self, config, layer):
        step = getattr(config, self.step)
        return step > 0 and (layer % step == 1 or step == 1)

    kind_notes: ClassVar[dict[str, dict[str, Note]]] = {
        "moe": {
            "mlp_input": "what the router (mlp.router.classifier) and the chosen expert read",
            "mlp_output": "the chosen expert's output times its router probability: softmax(router logits).max(); "
            "zeros for a token past the expert's capacity",
        }
    }


class SwitchEncoder(SwitchSparse, T5Encoder):
    """Switch Transformers' encoder: T5's, with a sparse feed-forward on every `encoder_sparse_step`-th block."""

    mlp = "layer.1.mlp"


class SwitchDecoder(SwitchSparse, T5Decoder):
    """Switch Transformers' decoder: T5's, with a sparse feed-forward on every `decoder_sparse_step`-th block."""

    step = "decoder_sparse_step"
    mlp = "layer.2.mlp"


class SwitchTransformers(EncoderDecoder):
    """Switch Transformers: T5 whose feed-forward is a top-1 mixture of experts every few blocks."""

    model_types = ("switch_transformers",)
    encoder = SwitchEncoder
    decoder = SwitchDecoder
    stacks = T5.stacks
    # Block 1 of each stack is sparse (step 2), block 0 dense, so both kinds are tested; capacity for every token.
    tiny = Tiny(
        "SwitchTransformersConfig",
        "SwitchTransformersForConditionalGeneration",
        {
            **T5.tiny.kwargs,
            "num_experts": 4,
            "expert_capacity": 64,
            "num_sparse_encoder_layers": 1,
            "num_sparse_decoder_layers": 1,
        },
    )


class Pop2PianoEncoder(T5Encoder):
    """Pop2Piano's encoder: T5's, over the audio features given as its input embeddings."""

    def locations(self):
        return {name: location for name, location in super().locations().items() if name != "embeddings"}

    absent = {
        "embeddings": "Pop2Piano's encoder reads input_features (the feature extractor's frames; under generate, "
        "a composer's embedding prepended by mel_conditioner) as its input embeddings: embed_tokens never runs on "
        "them. layers[0].layer_input is what the first block receives",
    }


class Pop2Piano(EncoderDecoder):
    """Pop2Piano: T5 (gated GELU feed-forward) over audio features, decoding MIDI tokens."""

    model_types = ("pop2piano",)
    encoder = Pop2PianoEncoder
    decoder = T5Decoder
    stacks = T5.stacks
    tiny = Tiny(
        "Pop2PianoConfig",
        "Pop2PianoForConditionalGeneration",
        {**T5.tiny.kwargs, "composer_vocab_size": 2},
    )
    #: `generate` prepends the embedding of a composer named here (Pop2Piano's checkpoint has 21).
    tiny_generation = {"composer_to_feature_token": {"composer1": 100, "composer2": 101}}


class LongT5(EncoderDecoder):
    """LongT5: T5's decoder over an encoder that attends within blocks; not served."""

    model_types = ("longt5",)
    refused = (
        "LongT5's encoder attends locally, not over the sequence: LongT5LocalAttention splits it into blocks of "
        "local_radius + 1 positions and scores each block's queries against the keys of its own and its two "
        "neighbouring blocks, inside the module (einsum, no attention interface), as [batch, block, heads, block_len, "
        "3 * block_len] with a relative bias over those 3 blocks; its transient-global attention "
        "(encoder_attention_type='transient-global') also scores every query against normalised per-block sums of "
        "its input (global_block_size positions each) with a bias of their own, in one softmax with the local "
        "keys. attnlens does not rebuild those blocked patterns as [batch, heads, query, key] yet, so neither stack "
        "is served (the decoder is T5's)"
    )
