"""The decoders of BART and the encoder-decoders built as it is, run alone as causal LMs (`BartForCausalLM`,
`MBartForCausalLM`, `WhisperForCausalLM`, ...: transformers' causal-LM registry holds them): the decoder stack of
bart.py's decoder families, at `model.decoder` (`model` a `...DecoderWrapper`), with a language-model head.

Each block is the decoder family's block: causal `self_attn`, a cross-attention (`encoder_attn`, renamed
`cross_attn`), then `fc1`, `activation_fn` and `fc2`. The causal LM's forward takes token ids alone, and a block given
no `encoder_hidden_states` skips its cross-attention, so its values are answered as absent with that reason, and the
block is the rest of the decoder block: post-norm (BART, PLBart, BlenderbotSmall, Marian, MVP), `layer_mid` is what
`self_attn_layer_norm` receives and the MLP reads that norm's output; pre-norm (mBART, Pegasus, Blenderbot,
BigBirdPegasus, Whisper), `layer_mid` is `layer_input + attention_output`, what `final_layer_norm` receives. The self-
attention cache is a plain `DynamicCache` here (transformers builds an `EncoderDecoderCache` only with encoder states
or on an encoder-decoder's config), which attnlens reads and edits as any decoder's. MVP's attention is arithmetic of
its own (XGLM's folded heads), read as XGLM's is.

The families are registered for the model types as plain `Family`s: `StandardizedTransformer` serves a model of one
of these types whose config is not an encoder-decoder's (the causal LM sets `is_encoder_decoder = False`); the
encoder-decoder classes keep their `EncoderDecoder` families (bart.py) and `StandardizedSeq2Seq`, and
`StandardizedTransformer` still refuses them (their config says `is_encoder_decoder`).
"""

from __future__ import annotations

from dataclasses import replace

from ..family import Family, Tiny, VLLMLayout
from ..locations import ModuleOutput, Operation
from ..locations.cache import NAMES as CACHE_VALUES
from ..values import WITH_CROSS_ATTENTION
from .bart import TINY, BartDecoder, BartEncoder, PreNormDecoder, PreNormEncoder, WhisperDecoder, embedded
from .xglm import folded

VLLM = VLLMLayout(
    refusal="attnlens has not compared vLLM with transformers on the decoders of BART's encoder-decoders run alone "
    "(...ForCausalLM), so it serves none of them there yet; the transformers engine serves them"
)
NEVER_RUNS = (
    "the block holds a cross-attention ({family.cross_attention}, renamed cross_attn), which runs only on an "
    "encoder's states (encoder_hidden_states): the causal LM is served on token ids alone, without encoder states, "
    "where each block skips it, so it never runs (the decoder run on an encoder's states is the encoder-decoder's: "
    "attnlens.StandardizedSeq2Seq)"
)


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


class MvpCausalLM(BartCausalLM):
    """MVP's decoder run alone (`MvpForCausalLM`): BART's post-norm decoder block, whose attention (`MvpAttention`) is
    BART's older arithmetic of its own, as XGLM's: the queries pre-scaled, the heads folded into the batch for
    `torch.bmm`, no clamp. The causal LM's decoder is built without MVP's prompts (`use_prompt` is the
    encoder-decoder's), so the keys are the sequence's own."""

    model_types = ("mvp",)
    vllm = VLLM
    sizes = replace(BartCausalLM.sizes, scale=(1.0,))
    tiny = Tiny("MvpConfig", "MvpForCausalLM", BartCausalLM.tiny.kwargs)

    def locations(self):
        return {
            **super().locations(),
            "attention_queries": folded("query_states_2", "query_states.reshape(*proj_shape)", "queries"),
            "attention_keys": folded("key_states_4", "key_states.reshape(*proj_shape)", "keys"),
            "attention_values": folded("value_states_4", "value_states.reshape(*proj_shape)", "values"),
            "attention_scores": folded("attn_weights_2", "attn_weights.view(bsz * self.num_heads", "scores"),
            "attention_probabilities": folded("attn_probs_0", "dropout(", "probabilities"),
            "attention_head_outputs": Operation(("attn_output_2",), anchor="attn_output.transpose(1, 2)"),
            "layer_output": ModuleOutput("", 0),  # MvpDecoderLayer returns a tuple
        }

    kind_notes = {
        "*": {
            "attention_queries": "pre-scaled: q_proj(x) * head_dim ** -0.5 (attn.scale is 1.0); a view of the heads "
            "folded into the batch",
            "attention_scores": "queries @ keys^T + mask (the queries carry the scale)",
        }
    }
