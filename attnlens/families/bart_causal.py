"""The decoders of BART and the encoder-decoders built as it is, run alone as causal LMs (`BartForCausalLM`,
`MBartForCausalLM`, `WhisperForCausalLM`, ...: transformers' causal-LM registry holds them): the decoder stack of
bart.py's decoder families, at `model.decoder` (`model` a `...DecoderWrapper`), with a language-model head.

Each block is the decoder family's block: causal `self_attn`, a cross-attention (`encoder_attn`, renamed
`cross_attn`), then `fc1`, `activation_fn` and `fc2`. The causal LM's forward takes token ids alone, and a block given
no `encoder_hidden_states` skips its cross-attention, so its values are answered as absent with that reason, and the
block is the rest of the decoder block: post-norm (BART, PLBart, BlenderbotSmall, Marian), `layer_mid` is what
`self_attn_layer_norm` receives and the MLP reads that norm's output; pre-norm (mBART, Pegasus, Blenderbot,
BigBirdPegasus, Whisper), `layer_mid` is `layer_input + attention_output`, what `final_layer_norm` receives. The self-
attention cache is a plain `DynamicCache` here (transformers builds an `EncoderDecoderCache` only with encoder states
or on an encoder-decoder's config), which attnlens reads and edits as any decoder's.

The families are registered for the model types as plain `Family`s: `StandardizedTransformer` serves a model of one
of these types whose config is not an encoder-decoder's (the causal LM sets `is_encoder_decoder = False`); the
encoder-decoder classes keep their `EncoderDecoder` families (bart.py) and `StandardizedSeq2Seq`, and
`StandardizedTransformer` still refuses them (their config says `is_encoder_decoder`).
"""

from __future__ import annotations

from ..family import Family, Tiny, VLLMLayout
from ..locations.cache import NAMES as CACHE_VALUES
from ..values import WITH_CROSS_ATTENTION
from .bart import TINY, BartDecoder, BartEncoder, PreNormDecoder, PreNormEncoder, WhisperDecoder

VLLM = VLLMLayout(
    refusal="attnlens has not compared vLLM with transformers on the decoders of BART's encoder-decoders run alone "
    "(...ForCausalLM), so it serves none of them there yet; the transformers engine serves them"
)
NEVER_RUNS = (
    "the block holds a cross-attention ({family.cross_attention}, renamed cross_attn), but the causal LM runs its "
    "decoder on token ids alone, without encoder states, and a block given none skips its cross-attention: it never "
    "runs (the encoder-decoder runs it: attnlens.StandardizedSeq2Seq)"
)

#: How each type's decoder turns the token embedding's output (`embeddings`) into layers[0]'s input.
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
    "whisper": "learned positions are added",
}


def embedded(family, config, layer) -> str:
    steps = EMBEDDED.get(config.model_type, "its positions are added")
    return f"the token embedding's output; {steps}, before layers[0]"


def without_cross_attention(encoder: type[Family]) -> dict:
    """The notes of the decoder block run without its cross-attention: the encoder family's, whose block it then is
    (apart from the direction of its self-attention)."""
    return {name: encoder.kind_notes["*"][name] for name in ("layer_mid", "mlp_norm_output")}


class RunAlone:
    """A decoder family of bart.py on its causal LM: the decoder stack at `model.decoder`, its blocks' cross-attention
    held (renamed `cross_attn`) but never run, its self-attention cache a plain `DynamicCache`."""

    layers = "model.decoder.layers"
    embed_tokens = "model.decoder.embed_tokens"
    padding_changes_values = (
        "positions count from the padded start: the decoder's position embeddings take the positions 0, 1, ... of "
        "the input (past the cache), not the attention mask"
    )

    def locations(self):
        """The decoder family's locations without the cross-attention's (it never runs)."""
        found = super().locations()
        return {name: location for name, location in found.items() if name not in WITH_CROSS_ATTENTION}

    kind_reasons = {
        "*": {
            **dict.fromkeys(sorted(WITH_CROSS_ATTENTION), NEVER_RUNS),
            **dict.fromkeys(CACHE_VALUES, None),  # a plain DynamicCache: served as on any decoder
        }
    }
    kind_notes = {"*": {"embeddings": embedded}}


class BartCausalLM(RunAlone, BartDecoder):
    """BART's post-norm decoder run alone: BART, PLBart, BlenderbotSmall, Marian (`...ForCausalLM`). Without the
    cross-attention the MLP reads `self_attn_layer_norm`'s output, as in BART's encoder block."""

    model_types = ("bart", "plbart", "blenderbot-small", "marian")
    vllm = VLLM
    mlp_norm = "self_attn_layer_norm"  # encoder_attn_layer_norm follows the cross-attention, which never runs
    final_norm = None
    tiny = Tiny(
        "BartConfig",
        "BartForCausalLM",
        {
            **TINY,
            "encoder_layers": 3,  # num_hidden_layers names the encoder's depth on BART's configs: kept equal
            "decoder_layers": 3,
            "init_std": 0.2,
            **dict.fromkeys(("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"), None),
            **dict.fromkeys(("intermediate_size", "initializer_range"), None),
        },
    )
    kind_notes = {"*": without_cross_attention(BartEncoder)}


class PreNormCausalLM(RunAlone, PreNormDecoder):
    """BART's pre-norm decoder run alone, with its final norm: mBART, Pegasus, Blenderbot (`...ForCausalLM`)."""

    model_types = ("mbart", "pegasus", "blenderbot")
    vllm = VLLM
    final_norm = "model.decoder.layer_norm"
    tiny = Tiny("MBartConfig", "MBartForCausalLM", BartCausalLM.tiny.kwargs)
    kind_notes = {"*": without_cross_attention(PreNormEncoder)}


class BigBirdPegasusCausalLM(PreNormCausalLM):
    """BigBirdPegasus's decoder run alone: Pegasus's pre-norm blocks with full causal self-attention (the block-sparse
    attention is the encoder's, which the causal LM has not), the final norm named `layernorm_embedding`."""

    model_types = ("bigbird_pegasus",)
    vllm = VLLM
    final_norm = "model.decoder.layernorm_embedding"
    tiny = Tiny("BigBirdPegasusConfig", "BigBirdPegasusForCausalLM", BartCausalLM.tiny.kwargs)
    kind_notes = {"*": {"final_norm_output": "layernorm_embedding(the last layer_output): the stack's final norm"}}


class WhisperCausalLM(RunAlone, WhisperDecoder):
    """Whisper's text decoder run alone (`WhisperForCausalLM`): pre-norm blocks whose queries carry the scale."""

    model_types = ("whisper",)
    vllm = VLLM
    final_norm = "model.decoder.layer_norm"
    tiny = Tiny(
        "WhisperConfig",
        "WhisperForCausalLM",
        {
            **BartCausalLM.tiny.kwargs,
            "num_mel_bins": 16,
            "max_source_positions": 32,
            "max_target_positions": 64,
            "begin_suppress_tokens": [],  # its default names ids past the tiny vocabulary
        },
    )
    kind_notes = {"*": without_cross_attention(PreNormEncoder)}
