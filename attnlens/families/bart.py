"""BART and the encoder-decoders built as it is (Marian, Pegasus, mBART, PLBart, Blenderbot, Whisper's text side): an
encoder and a decoder of `BartAttention`-style blocks, whose decoder blocks read the encoder's output through a
cross-attention (`encoder_attn`, renamed `cross_attn`).

Each block runs `self_attn` (the shared attention interface, BERT's eager function: scores plus the mask into the
softmax), then in a decoder block `encoder_attn` (queries from the decoder, keys and values from the encoder's output,
cached once on the first step), then `fc1`, `activation_fn` and `fc2`, which the block calls itself (`fc2` is renamed
`mlp`, as on BioGPT). BART and Marian normalise after each residual add (post-norm: `self_attn_layer_norm`,
`encoder_attn_layer_norm`, `final_layer_norm` follow their sublayers, and the stacks have no final norm); mBART,
Pegasus and Whisper normalise before each sublayer (`PreNorm`), with a final norm on each stack (`layer_norm`).

The stacks' paths are from each stack's module (`model.encoder`, `model.decoder`); the logits are the head model's.
"""

from __future__ import annotations

from dataclasses import replace

from ..family import EncoderDecoder, Family, Tiny
from ..locations import INTERFACE_CALL, Location, ModuleInput, ModuleOutput, Operation, OutputField, softmax_argument
from ..locations.cache import NAMES as CACHE_VALUES
from ..locations.cache import NO_CACHE
from ..parts import identities, scoring
from ..parts.sizes import Sizes, same_as

POST_NORM = "BART normalises after each residual add, not before a sublayer: {what}"


def interface_attention_locations(family: Family, prefix: str = "") -> dict:
    """The values of an attention that calls the shared attention interface (`self_attn`, or with `prefix="cross_"`
    `cross_attn`): the call's arguments and result, the softmax's argument, the pattern the family's eager function
    forms, the output projection's input and the module's output."""
    probabilities, anchor = family.eager.probabilities
    return {
        f"{prefix}attention_queries": Operation((INTERFACE_CALL,), "arg", 1),
        f"{prefix}attention_keys": Operation((INTERFACE_CALL,), "arg", 2),
        f"{prefix}attention_values": Operation((INTERFACE_CALL,), "arg", 3),
        f"{prefix}attention_scores": softmax_argument(INTERFACE_CALL),
        f"{prefix}attention_probabilities": Operation((INTERFACE_CALL, probabilities), anchor=anchor),
        f"{prefix}attention_head_outputs": Operation((INTERFACE_CALL,), "output", 0),
        f"{prefix}attention_premix": ModuleInput(family.output_projection),
        f"{prefix}attention_output": ModuleOutput("", 0),
    }


#: How each type's stacks turn the token embedding's output (`embeddings`) into layers[0]'s input.
EMBEDDED = {
    "bart": "learned positions are added, then layernorm_embedding",
    "plbart": "learned positions are added, then layernorm_embedding",
    "mbart": "learned positions are added, then layernorm_embedding",
    "mvp": "learned positions are added, then layernorm_embedding",
    "blenderbot-small": "layernorm_embedding normalises it, then learned positions are added",
    "blenderbot": "learned positions are added",
    "marian": "multiplied by sqrt(d_model) where config.scale_embedding, then sinusoidal positions are added",
    "pegasus": "multiplied by sqrt(d_model) where config.scale_embedding, then sinusoidal positions are added",
    "bigbird_pegasus": "learned positions are added (its layernorm_embedding is the stack's final norm)",
    "m2m_100": "sinusoidal positions are added",
    "whisper": "learned positions are added",
}


def embedded(family, config, layer) -> str:
    steps = EMBEDDED.get(config.model_type, "its positions are added")
    return f"the token embedding's output; {steps}, before layers[0]"


class BartEncoder(Family):
    """BART's encoder: bidirectional self-attention and an MLP the block runs itself, post-norm."""

    layers = "layers"
    embed_tokens = "embed_tokens"
    final_norm = None
    attention_norm = None
    mlp_norm = "self_attn_layer_norm"  # post-norm: the norm whose output the MLP reads
    output_projection = "out_proj"
    mlp = "fc2"  # no MLP module: its last step carries the MLP's values (renamed `mlp`)
    activation = "activation_fn"
    down_projection = "fc2"
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=(same_as("num_heads"),), scale=("scaling",))

    def locations(self):
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            **self.attention_locations(),
            "layer_mid": ModuleInput(self.mlp_norm),
            "mlp_norm_output": ModuleOutput(self.mlp_norm),
            "mlp_input": ModuleInput("fc1"),
            "mlp_activation": ModuleInput(),  # fc2 receives the activation's output itself (dropout is off)
            "mlp_neurons": ModuleInput(),
            "mlp_output": ModuleOutput(),
            "layer_output": ModuleOutput(""),
        }

    def attention_locations(self, prefix: str = "") -> dict:
        """The attention values of `self_attn` (or, with `prefix="cross_"`, of `cross_attn`): BERT's eager function
        inside `BartAttention`; an unpadded encoder batch has no mask, so the scores are the softmax's argument."""
        return interface_attention_locations(self, prefix)

    ScoreFunction = scoring.Bidirectional

    class Identities(identities.Identities):
        def mlp_module(self, block):
            return block  # the block calls fc1, activation_fn and fc2 itself

        def mlp_forward(self, block, mlp_input):
            return block.fc2(block.activation_fn(block.fc1(mlp_input)))

        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Post-norm: a sublayer's update joins the stream, and the norm after it follows, except where the
            identities name the sum itself (`layer_mid`, what the MLP's norm receives)."""
            if sublayer == "mlp":
                return block.final_layer_norm(getattr(block, self.family.mlp_norm)(stream) + update)
            if sublayer == "attention" and "cross_attention_input" in self.family.locations():
                return block.self_attn_layer_norm(stream + update)  # what the cross-attention reads, where it runs
            return stream + update

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(what="the attention reads the block input itself"),
            "final_norm_output": "BART's stacks have no final norm: the last block's output ends in its own "
            "final_layer_norm",
            **dict.fromkeys(CACHE_VALUES, NO_CACHE),
        }
    }
    kind_notes = {
        "*": {
            "attention_probabilities": "bidirectional: every query sees every key that is not padding",
            "layer_mid": "layer_input + attention_output, what self_attn_layer_norm receives (post-norm)",
            "mlp_norm_output": "self_attn_layer_norm(layer_mid): the MLP's input and the stream its output joins",
            "mlp_activation": "what fc2 receives: activation_fn(fc1(x)), the same tensor as mlp_neurons (no gate)",
            "layer_output": "final_layer_norm(mlp_norm_output + mlp_output): post-norm",
            "embeddings": embedded,
        }
    }


#: A decoder keeps the cache an encoder does not: its self-attention's half of transformers' `EncoderDecoderCache`.
DECODER_CACHE = dict.fromkeys(CACHE_VALUES)
CROSS_NOTES = {
    "cross_attention_probabilities": "each decoder position over every encoder position that is not padding",
    "cross_attention_keys": "from the encoder's output; computed on the first step and cached for the others",
}


def with_cross_attention(family: Family, found: dict, stream: Location, norm: Location | None = None) -> dict:
    """A decoder block's locations `found` with the cross-attention's between the self-attention and `layer_mid`:
    the stream entering it (`stream`), its norm's output (`norm`, pre-norm), its values, and the logits (read on the
    model: the head's output)."""
    ordered = {}
    for name, location in found.items():
        if name == "layer_mid":
            ordered["cross_attention_input"] = stream
            if norm is not None:
                ordered["cross_attention_norm_output"] = norm
            ordered.update(family.attention_locations("cross_"))
        ordered[name] = location
    return {**ordered, "logits": OutputField("logits")}


class BartDecoder(BartEncoder):
    """BART's decoder: causal self-attention, then cross-attention over the encoder's output, then the MLP."""

    cross_attention = "encoder_attn"
    mlp_norm = "encoder_attn_layer_norm"

    def locations(self):
        return with_cross_attention(self, super().locations(), ModuleInput(self.cross_attention))

    ScoreFunction = scoring.Causal

    kind_reasons = {
        "*": {
            **DECODER_CACHE,
            "cross_attention_norm_output": POST_NORM.format(what="the cross-attention reads the stream itself"),
        }
    }
    kind_notes = {
        "*": {
            "attention_probabilities": "causal: each decoder position sees the positions up to its own",
            "cross_attention_input": "self_attn_layer_norm(layer_input + attention_output) (post-norm)",
            "layer_mid": "cross_attention_input + cross_attention_output, what encoder_attn_layer_norm receives "
            "(post-norm)",
            "mlp_norm_output": "encoder_attn_layer_norm(layer_mid): the MLP's input and the stream its output joins",
            **CROSS_NOTES,
        }
    }


class PreNormEncoder(BartEncoder):
    """An encoder of BART's blocks normalised before each sublayer, with a final norm (mBART, Pegasus, Whisper)."""

    attention_norm = "self_attn_layer_norm"
    mlp_norm = "final_layer_norm"
    final_norm = "layer_norm"

    def locations(self):
        found = super().locations()
        ordered = {}
        for name, location in found.items():
            if name == "attention_queries":
                ordered["attention_norm_output"] = ModuleOutput(self.attention_norm)
            ordered[name] = location
        return {**ordered, "final_norm_output": ModuleOutput(self.final_norm)}

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            return stream + update

    kind_reasons = {"*": {"attention_norm_output": None, "final_norm_output": None}}
    kind_notes = {
        "*": {
            "layer_mid": "layer_input + attention_output, what final_layer_norm (the MLP's norm) receives",
            "mlp_norm_output": "final_layer_norm(layer_mid): the MLP's input",
            "layer_output": "layer_mid + mlp_output",
        }
    }


class PreNormDecoder(PreNormEncoder):
    """A decoder of BART's blocks normalised before each sublayer, the cross-attention's included."""

    cross_attention = "encoder_attn"
    cross_attention_norm = "encoder_attn_layer_norm"

    def locations(self):
        return with_cross_attention(
            self,
            super().locations(),
            ModuleInput(self.cross_attention_norm),
            ModuleOutput(self.cross_attention_norm),
        )

    ScoreFunction = scoring.Causal

    kind_reasons = {"*": DECODER_CACHE}
    kind_notes = {
        "*": {
            "attention_probabilities": "causal: each decoder position sees the positions up to its own",
            "cross_attention_input": "layer_input + attention_output",
            "layer_mid": "cross_attention_input + cross_attention_output, what final_layer_norm receives",
            **CROSS_NOTES,
        }
    }


#: A tiny BART-shaped encoder-decoder: two blocks per stack, four heads of 16.
TINY = dict(
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    vocab_size=128,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
)


class Bart(EncoderDecoder):
    """BART and the post-norm encoder-decoders built as it is: PLBart, BlenderbotSmall, Marian."""

    model_types = ("bart", "plbart", "blenderbot-small", "marian")
    encoder = BartEncoder
    decoder = BartDecoder
    tiny = Tiny("BartConfig", "BartForConditionalGeneration", TINY)


class PreNormBart(EncoderDecoder):
    """BART's blocks normalised before each sublayer, with a final norm on each stack: mBART, Pegasus, Blenderbot,
    M2M100 (NLLB)."""

    model_types = ("mbart", "pegasus", "blenderbot", "m2m_100")
    encoder = PreNormEncoder
    decoder = PreNormDecoder
    tiny = Tiny("MBartConfig", "MBartForConditionalGeneration", TINY)


class WhisperScaling:
    """Whisper's attention scales the queries as it projects them and calls the attention function with scaling 1.0:
    the queries read carry the scale, and `heads.scale` is 1.0."""

    sizes = replace(BartEncoder.sizes, scale=(1.0,))
    kind_notes = {
        "*": {
            "attention_queries": "pre-scaled: q_proj(x) * head_dim ** -0.5 (attn.scale is 1.0)",
            "cross_attention_queries": "pre-scaled: q_proj(x) * head_dim ** -0.5 (cross_attn.scale is 1.0)",
        }
    }


class WhisperEncoder(WhisperScaling, PreNormEncoder):
    """Whisper's audio encoder: two convolutions over the mel frames (stride 2: one position per 20 ms of audio),
    learned positions, then pre-norm BART blocks."""

    embed_tokens = "conv2"

    kind_notes = {
        "*": {
            "embeddings": "conv2's output [batch, hidden, frames]: the mel frames convolved (stride 2, one position "
            "per 20 ms of audio) before GELU, the transpose and the positions; layers[0].layer_input is [batch, "
            "position, hidden]",
        }
    }


class WhisperDecoder(WhisperScaling, PreNormDecoder):
    """Whisper's text decoder: pre-norm BART blocks whose cross-attention reads the audio positions."""


class Whisper(EncoderDecoder):
    """Whisper: an audio encoder over log-mel frames (`input_features`) and a text decoder of pre-norm BART blocks
    whose cross-attention reads the audio positions (each 20 ms of the 30 s window)."""

    model_types = ("whisper",)
    encoder = WhisperEncoder
    decoder = WhisperDecoder
    tiny = Tiny(
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        {**TINY, "num_mel_bins": 16, "max_source_positions": 32, "max_target_positions": 64},
    )
