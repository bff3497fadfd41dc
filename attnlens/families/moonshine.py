"""Moonshine: a speech encoder-decoder over raw audio. The encoder's stem is three convolutions over the 16 kHz
waveform (`conv1` kernel 127 stride 64, tanh, a group norm, `conv2` kernel 7 stride 3, GELU, `conv3` kernel 3 stride 2,
GELU: one position per 384 samples, 24 ms), then pre-norm blocks; the decoder is pre-norm blocks of a causal
self-attention, a cross-attention over the encoder's output and a gated MLP.

Both stacks' self-attentions are `MoonshineAttention` calling the shared attention interface with the eager function
of Moonshine's file (Llama's: `q @ k^T * scaling`, plus the mask, softmax), after rotating the queries and keys by a
rotary embedding of the position (`rotary_emb`, one per stack): on the first `partial_rotary_factor` of each head's
dimensions only, and interleaved (each pair of neighbouring dimensions is rotated together, `rotate_half` over
`x[..., 0::2]` and `x[..., 1::2]`). The cross-attention is the same module without the rotation. Norms are
`LayerNorm` without a bias (`input_layernorm`, `post_attention_layernorm`, in a decoder block `final_layernorm`
before the MLP), and each stack ends in one (`layer_norm`, `norm`); the logits are `proj_out`'s.
"""

from __future__ import annotations

import torch

from ..family import EncoderDecoder, Family, MLPArithmetic, Tiny, after_attention
from ..locations import ModuleInput, ModuleOutput
from ..locations.cache import NAMES as CACHE_VALUES
from ..locations.cache import NO_CACHE
from ..parts import identities, scoring
from ..parts.notes import Note
from .bart import CROSS_NOTES, DECODER_CACHE, BartEncoder, with_cross_attention

ROTATED = (
    "after the rotary embedding of its position, on the first {part} of each head's dimensions, interleaved (each "
    "pair of neighbouring dimensions rotated together)"
)
#: Why a checkpoint that pads its heads (`config.pad_head_dim_to_multiple_of`: 8 pads moonshine-tiny's 36 dimensions to
#: 40) leaves the per-head values unserved.
PADDED = (
    "Moonshine pads each head with zeros to a multiple of config.pad_head_dim_to_multiple_of before the attention "
    "function and cuts the function's output back after it: what the function receives and returns are not the "
    "model's heads of head_dim (the scores, the pattern and the premix are served)"
)
PADDED_REASONS: dict[str, Note] = dict.fromkeys(
    ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs"), PADDED
)


def rotated_part(family, config, layer) -> str:
    factor = (config.rope_parameters or {}).get("partial_rotary_factor") or 1.0
    return ROTATED.format(part=f"{factor:g}")


class MoonshineEncoder(Family):
    """Moonshine's encoder: pre-norm blocks of a bidirectional rotary self-attention and an MLP (`fc1`, GELU,
    `fc2`), after the convolution stem; a final `layer_norm`."""

    layers = "layers"
    embed_tokens = "conv3"
    final_norm = "layer_norm"
    activation = "activation_fn"
    down_projection = "fc2"

    # the interface's arguments and result, the softmax's argument (as the family's own: it reads only `eager`)
    attention_locations = BartEncoder.attention_locations

    def locations(self):
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_norm_output": ModuleOutput(self.attention_norm),
            **self.attention_locations(),  # type: ignore[misc]
            **{name: location for name, location in after_attention(self).items() if name != "logits"},
        }

    def layer_kind(self, config, layer):
        return frozenset({"padded"}) if getattr(config, "pad_head_dim_to_multiple_of", None) else frozenset()

    ScoreFunction = scoring.Bidirectional

    class Identities(identities.Identities):
        def mlp_arithmetic(self, mlp):
            return MLPArithmetic(
                lambda neurons: mlp.fc2(neurons),
                lambda x: mlp.fc1(x),
                lambda z: mlp.activation_fn(z),
                lambda x, activation: activation,
                says=("fc1(mlp input)", "activation", "fc2(neurons)"),
            )

    kind_reasons = {"*": dict.fromkeys(CACHE_VALUES, NO_CACHE), "padded": PADDED_REASONS}
    kind_notes = {
        "*": {
            "embeddings": "conv3's output [batch, hidden, positions]: the waveform through the convolution stem "
            "(one position per 384 samples, 24 ms at 16 kHz) before the last GELU and the transpose; "
            "layers[0].layer_input is [batch, position, hidden]",
            "attention_queries": rotated_part,
            "attention_keys": rotated_part,
            "attention_probabilities": "bidirectional: every query sees every position that is not padding",
            "mlp_activation": "activation_fn(fc1(x)), the same tensor as mlp_neurons (no gate)",
        }
    }


class MoonshineDecoder(MoonshineEncoder):
    """Moonshine's decoder: pre-norm blocks of a causal rotary self-attention, a cross-attention (no rotation) over
    the encoder's output, and a gated MLP (`fc1`'s output split in two: `activation_fn(second half) * first
    half`, then `fc2`); a final `norm`."""

    embed_tokens = "embed_tokens"
    final_norm = "norm"
    cross_attention = "encoder_attn"
    cross_attention_norm = "post_attention_layernorm"
    mlp_norm = "final_layernorm"

    def locations(self):
        norm = self.cross_attention_norm
        return with_cross_attention(self, super().locations(), ModuleInput(norm), ModuleOutput(norm))

    ScoreFunction = scoring.Causal

    class Identities(identities.Identities):
        def mlp_arithmetic(self, mlp):
            return MLPArithmetic(
                lambda neurons: mlp.fc2(neurons),
                lambda x: mlp.fc1(x).chunk(2, dim=-1)[1],
                lambda z: mlp.activation_fn(z),
                lambda x, activation: activation * mlp.fc1(x).chunk(2, dim=-1)[0],
                says=("fc1(mlp input)'s second half", "activation * its first half", "fc2(neurons)"),
            )

    kind_reasons = {
        "*": DECODER_CACHE,
        "padded": {**PADDED_REASONS, **{f"cross_{name}": reason for name, reason in PADDED_REASONS.items()}},
    }
    kind_notes = {
        "*": {
            "embeddings": "embed_tokens' output, layers[0]'s input: positions enter through the rotary embedding",
            "attention_probabilities": "causal: each decoder position sees the positions up to its own",
            "cross_attention_input": "layer_input + attention_output",
            "layer_mid": "cross_attention_input + cross_attention_output, what final_layernorm receives",
            "mlp_activation": "activation_fn of fc1(x)'s second half (the gate)",
            "mlp_neurons": "mlp_activation * fc1(x)'s first half: what fc2 receives",
            **CROSS_NOTES,
        }
    }


#: A tiny Moonshine: two blocks per stack, four heads of 16 in both (Moonshine's attention views its queries by the
#: key/value heads, and sets the config's head counts as it builds each stack's: the stacks' counts must agree), a
#: half-rotary embedding.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    encoder_num_hidden_layers=2,
    decoder_num_hidden_layers=2,
    encoder_num_attention_heads=4,
    decoder_num_attention_heads=4,
    vocab_size=128,
    max_position_embeddings=128,
    partial_rotary_factor=0.5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=1,
)


class Moonshine(EncoderDecoder):
    """Moonshine: an encoder over the raw waveform (`input_values`, a convolution stem then rotary pre-norm blocks)
    and a decoder of rotary pre-norm blocks with a cross-attention over the audio positions."""

    model_types = ("moonshine",)
    encoder = MoonshineEncoder
    decoder = MoonshineDecoder
    hop_seconds = 1 / 16000  # the waveform's samples
    tiny = Tiny("MoonshineConfig", "MoonshineForConditionalGeneration", TINY)


#: Why the streaming encoder's final norm output is not served.
ADDED_IN_PLACE = (
    "Moonshine Streaming's decoder adds its learned positions to the encoder's output in place (`encoder_hidden_states "
    "+= pos_emb(...)`): the tensor final_norm returns is changed after it is read (read layers[-1].layer_output)"
)


class StreamingWindows(scoring.Bidirectional):
    """The streaming encoder's mask: each layer's query sees `config.encoder_config.sliding_windows[layer]` = (left,
    right) keys around it (the `left` keys up to its own, the `right - 1` after it), and not padding; transformers
    applies the windows only where an attention mask is given, and every key is seen without one."""

    def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None):
        found = super().mask(num_queries, num_keys, config, layer, key_mask, dtype, device)
        if key_mask is None:
            return found
        left, right = config.encoder_config.sliding_windows[layer]
        keys = torch.arange(num_keys, device=found.device)
        distance = keys[num_keys - num_queries :, None] - keys[None, :]
        inside = ((distance >= 0) & (distance < left)) | ((distance < 0) & (-distance < right))
        return found.masked_fill(~inside, torch.finfo(dtype).min)


class MoonshineStreamingEncoder(MoonshineEncoder):
    """Moonshine Streaming's encoder: the waveform cut into 5 ms frames, each normalised (mean and RMS), compressed
    (asinh) and projected (`embedder.linear`, SiLU), then two causal convolutions (stride 2 each: one position per
    20 ms); pre-norm blocks of a self-attention without positions (no rotary embedding: positions enter through the
    causal convolutions) within per-layer windows, and an MLP. Its norms multiply by `gamma + 1`."""

    embed_tokens = "embedder"
    final_norm = "final_norm"
    absent = {**Family.absent, "final_norm_output": ADDED_IN_PLACE}

    def locations(self):
        found = super().locations()
        found.pop("final_norm_output")
        return {**found, "embeddings": ModuleOutput(self.embed_tokens, 0)}

    def layer_kind(self, config, layer):
        return frozenset()  # the encoder's attention pads no heads

    ScoreFunction = StreamingWindows

    class Identities(identities.Identities):
        def norm_gain(self, norm):
            return norm.gamma + norm.unit_offset  # MoonshineStreamingLayerNorm: an affine-free norm times gamma + 1

    kind_notes = {
        "*": {
            "embeddings": "the embedder's output [batch, position, hidden], layers[0]'s input: 5 ms frames projected, "
            "then two causal convolutions (one position per 20 ms)",
            "attention_queries": "no rotary embedding: q_proj(x) by heads",
            "attention_keys": "no rotary embedding: k_proj(x) by heads",
            "attention_probabilities": "bidirectional within each layer's window (config.encoder_config."
            "sliding_windows[layer]: left, right) where an attention mask is given; every position without one "
            "(transformers applies the windows with a mask only)",
        }
    }


class MoonshineStreamingDecoder(MoonshineDecoder):
    """Moonshine Streaming's decoder: Moonshine's, whose cross-attention reads the encoder's output plus learned
    positions (`pos_emb`), projected to the decoder's width (`proj`, where the widths differ)."""

    kind_notes = {
        "*": {
            "cross_attention_keys": "k_proj(proj(encoder output + pos_emb(position))): computed on the first step and "
            "cached for the others",
        }
    }


class MoonshineStreaming(EncoderDecoder):
    """Moonshine Streaming: a streaming encoder over the raw waveform (`input_values`: framed, causal convolutions,
    windowed attention without positions) and Moonshine's rotary decoder, whose cross-attention reads the audio
    positions with learned positions added."""

    model_types = ("moonshine_streaming",)
    encoder = MoonshineStreamingEncoder
    decoder = MoonshineStreamingDecoder
    tiny = Tiny(
        "MoonshineStreamingConfig",
        "MoonshineStreamingForConditionalGeneration",
        {
            **{k: v for k, v in TINY.items() if not k.startswith(("encoder_", "decoder_num"))},
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,  # (read by Moonshine's attention, not a field of the config)
            "encoder_config": dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                sliding_windows=[[3, 2], [2, 1]],
            ),
        },
    )
