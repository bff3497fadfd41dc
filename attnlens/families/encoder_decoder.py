"""Encoder-decoders of two models: transformers' `EncoderDecoderModel` (an encoder of one type, a decoder of another or
the same, whose blocks gain a cross-attention with `add_cross_attention=True`), its family composed from the two
models' own; and the types attnlens does not serve yet (`SpeechEncoderDecoderModel`, ProphetNet), with why.

`EncoderDecoderModel` holds the encoder as its type's base model (`AutoModel`: `BertModel`, at `encoder`) and the
decoder as its type's causal LM (`AutoModelForCausalLM`: `BertLMHeadModel`, `GPT2LMHeadModel`, at `decoder`); its
config holds each model's config (`config.encoder`, `config.decoder`), which that stack's family reads. The encoder's
family is its type's registered family on the base model's paths (the head's prefix dropped, as `StandardizedEncoder`
serves a `BertModel`), bidirectional as its config makes it, with no KV cache and no logits. The decoder's is its
type's family with the cross-attention transformers adds to its blocks, where attnlens knows it (`CROSS_ATTENTIONS`):

- BERT, RoBERTa (post-norm): `crossattention`, a second `BertAttention` (its `self` a `BertCrossAttention`: queries from
  the decoder, keys and values from the encoder's output) reading the self-attention's normalised output
  (`attention.output.LayerNorm`'s), then its own `output.LayerNorm`, whose output the MLP reads.
- GPT-2 (pre-norm): `crossattention`, a `GPT2Attention` whose `q_attn` projects the queries and `c_attn` the encoder's
  keys and values, behind a norm of its own (`ln_cross_attn`), its output added to the stream.

The cross-attention's values are the self-attention's locations on that module (the same attention class, the same
attention function), its scores the softmax's argument (a source mask is added only where one is given). Both stacks'
sublayers are renamed by path (`attention` -> `self_attn`, `crossattention` -> `cross_attn`): a BERT block holds two
`BertAttention` modules, which a rename by class (BERT's own) cannot tell apart.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnknownFamily
from ..family import TINY_DEFAULTS, EncoderDecoder, Family, Tiny, base_model_paths
from ..locations import INTERFACE_CALL, Location, ModuleInput, ModuleOutput, softmax_argument
from ..locations.cache import NAMES as CACHE_VALUES
from ..locations.cache import NO_CACHE
from ..parts.notes import Note
from ..values import BY_NAME
from .bart import CROSS_NOTES
from .bert import POST_NORM, Bert, Roberta
from .gpt2 import GPT2


class PathRenames:
    """A stack's family whose self- and cross-attention are renamed by their paths in the block."""

    def renames(self, engine: str = "transformers") -> dict:
        found = {k: v for k, v in super().renames(engine).items() if v not in ("self_attn", "cross_attn")}  # type: ignore[misc]
        found[self.attention] = "self_attn"  # type: ignore[attr-defined]
        if self.cross_attention:  # type: ignore[attr-defined]
            found[self.cross_attention] = "cross_attn"  # type: ignore[attr-defined]
        return found


class AsEncoder(PathRenames):
    """A family as `EncoderDecoderModel`'s encoder: its base model, which runs once over the source and has no head."""

    def locations(self) -> dict[str, Location]:
        found = dict(super().locations())  # type: ignore[misc]
        found.pop("logits", None)
        return found

    kind_reasons: dict[str, dict[str, Note]] = {
        "*": {
            **dict.fromkeys(CACHE_VALUES, NO_CACHE),
            "logits": "the encoder is its type's base model, without a head: the logits are the decoder's "
            "(model.logits)",
        }
    }


class CrossAttending(PathRenames):
    """A decoder family with the cross-attention transformers adds to its blocks (`add_cross_attention=True`): its
    values are the self-attention's locations on `cross_attention`, between the self-attention and `layer_mid`, after
    the stream entering it (and, pre-norm, its norm's output)."""

    cross_attention = "crossattention"
    cross_attention_norm: str | None = None

    def locations(self) -> dict[str, Location]:
        found = super().locations()  # type: ignore[misc]
        norm = self.cross_attention_norm
        cross: dict[str, Location] = {
            "cross_attention_input": ModuleInput(norm) if norm else ModuleInput(self.cross_attention),
            **({"cross_attention_norm_output": ModuleOutput(norm)} if norm else {}),
        }
        for name, location in found.items():
            if BY_NAME[name].scope == "attention" and f"cross_{name}" in BY_NAME:
                cross[f"cross_{name}"] = location
        # no mask is added to the cross scores where no source mask is given: the softmax's argument is them always
        cross["cross_attention_scores"] = softmax_argument(INTERFACE_CALL, module=self.attention_function_module)
        ordered: dict[str, Location] = {}
        for name, location in found.items():
            if name == "layer_mid":
                ordered.update(cross)
            ordered[name] = location
        return ordered

    #: The submodule of the attention whose forward calls the attention function ("": the attention module itself).
    attention_function_module = ""


class BertCrossAttention(CrossAttending):
    """BERT's post-norm decoder block with `crossattention`: `attention.output.LayerNorm` normalises the
    self-attention's residual sum, which the cross-attention reads; `crossattention.output.LayerNorm` normalises its
    own, which the MLP reads and its output joins."""

    mlp_norm = "crossattention.E_output.LayerNorm"
    attention_function_module = "self"

    class Identities(Bert.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            if sublayer == "attention":  # what the cross-attention reads: the self-attention's sum, normalised
                return block.attention.output.LayerNorm(stream + update)
            if sublayer == "cross_attention":  # layer_mid: what crossattention.output.LayerNorm receives
                return stream + update
            return block.output.LayerNorm(block.crossattention.output.LayerNorm(stream) + update)

    kind_reasons: dict[str, dict[str, Note]] = {
        "*": {
            "cross_attention_norm_output": POST_NORM.format(what="the cross-attention reads the stream itself"),
        }
    }
    kind_notes: dict[str, dict[str, Note]] = {
        "*": {
            "cross_attention_input": "attention.output.LayerNorm(layer_input + attention_output) (post-norm)",
            "layer_mid": "cross_attention_input + cross_attention_output, what crossattention.output.LayerNorm "
            "receives (post-norm)",
            "mlp_norm_output": "crossattention.output.LayerNorm(layer_mid): the MLP's input and the stream its output "
            "joins",
            **CROSS_NOTES,
        }
    }


class GPT2CrossAttention(CrossAttending):
    """GPT-2's pre-norm decoder block with `crossattention` behind `ln_cross_attn`."""

    cross_attention_norm = "ln_cross_attn"

    kind_reasons: dict[str, dict[str, Note]] = {
        "*": {f"cross_{name}": note for name, note in GPT2.kind_reasons["*"].items()}  # reorder_and_upcast_attn
    }
    kind_notes: dict[str, dict[str, Note]] = {
        "*": {
            "cross_attention_input": "layer_input + attention_output, what ln_cross_attn receives",
            "cross_attention_queries": "q_attn(ln_cross_attn(cross_attention_input)); the keys and values are c_attn's "
            "split of the encoder's output",
            "layer_mid": "cross_attention_input + cross_attention_output, what ln_2 receives",
            **CROSS_NOTES,
        }
    }


#: The decoder families whose blocks' cross-attention (`add_cross_attention=True`) attnlens knows, by family class.
CROSS_ATTENTIONS: dict[type[Family], type[CrossAttending]] = {
    Bert: BertCrossAttention,
    Roberta: BertCrossAttention,
    GPT2: GPT2CrossAttention,
}
#: The encoder families attnlens composes (tested as `EncoderDecoderModel`'s encoder: tests/test_seq2seq.py).
ENCODERS: tuple[type[Family], ...] = (Bert, Roberta)


def _family_of(config: Any, stack: str) -> type[Family]:
    from ..registry import registered

    found = registered().get(config.model_type)
    if found is None:
        raise UnknownFamily(
            f"attnlens has no encoder-decoder family for this EncoderDecoderModel: it has no family for its {stack}'s "
            f"model type {config.model_type!r}"
        )
    return found


def encoder_family(config: Any) -> type[Family]:
    """The family of `EncoderDecoderModel`'s encoder of `config`: its type's, on the base model's paths."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    family = _family_of(config, "encoder")
    if family not in ENCODERS:
        raise UnknownFamily(
            f"attnlens has no encoder-decoder family for this EncoderDecoderModel: it composes encoders of the types "
            f"{', '.join(t for f in ENCODERS for t in f.model_types)} (those tested as its encoder), not "
            f"{config.model_type!r}"
        )
    names = MODEL_MAPPING_NAMES[config.model_type]  # the base model's class (`AutoModel` builds it)
    base = getattr(transformers, names if isinstance(names, str) else names[0])
    paths = base_model_paths(family, f"{base.base_model_prefix}.")
    return type(f"{family.__name__}Encoder", (AsEncoder, family), paths)


def decoder_family(config: Any) -> type[Family]:
    """The family of `EncoderDecoderModel`'s decoder of `config`: its type's, with the cross-attention it adds."""
    family = _family_of(config, "decoder")
    cross = CROSS_ATTENTIONS.get(family)
    if cross is None:
        known = ", ".join(t for f in CROSS_ATTENTIONS for t in f.model_types)
        raise UnknownFamily(
            f"attnlens has no encoder-decoder family for this EncoderDecoderModel: it knows where transformers puts "
            f"the cross-attention that add_cross_attention=True adds to the blocks of {known} decoders, not of "
            f"{config.model_type!r} ones"
        )
    if not getattr(config, "add_cross_attention", False) or not getattr(config, "is_decoder", False):
        raise UnknownFamily(
            "attnlens has no encoder-decoder family for this EncoderDecoderModel: its decoder's config does not set "
            "is_decoder and add_cross_attention, so its blocks neither attend causally nor read the encoder"
        )
    return type(f"{family.__name__}Decoder", (cross, family), {})


def tiny_stack(family: type[Family], **overrides: Any) -> dict:
    """A sub-config of a tiny `EncoderDecoderConfig`: `family`'s tiny recipe, two blocks, `overrides` on top."""
    assert family.tiny is not None
    merged = {**TINY_DEFAULTS, **family.tiny.kwargs}
    depth = "n_layer" if "n_layer" in merged else "num_hidden_layers"  # GPT-2 spells it n_layer
    merged.update({depth: 2}, **overrides)
    return {"model_type": family.model_types[0], **{k: v for k, v in merged.items() if v is not None}}


def tiny_pair(encoder: type[Family], decoder: type[Family]) -> dict:
    return dict(
        encoder=tiny_stack(encoder, is_decoder=False),
        decoder=tiny_stack(decoder, is_decoder=True, add_cross_attention=True),
        decoder_start_token_id=2,
        pad_token_id=0,
    )


class EncoderDecoderModels(EncoderDecoder):
    """transformers' `EncoderDecoderModel`: any encoder and any decoder given a cross-attention, its family composed
    from the two types' families (`encoder_family`, `decoder_family`) on each model's config."""

    model_types = ("encoder-decoder",)
    stacks = {"encoder": "encoder", "decoder": "decoder"}
    tiny = Tiny(
        "EncoderDecoderConfig",
        "EncoderDecoderModel",
        tiny_pair(Bert, Bert),
        layouts={"bert-gpt2": tiny_pair(Bert, GPT2), "roberta": tiny_pair(Roberta, Roberta)},
    )

    def composed(self, config: Any) -> EncoderDecoder:
        if hasattr(self, "decoder") or not hasattr(config, "encoder"):
            return self  # composed already (or a subclass naming its stacks); a config without its models' (5.19's)
        encoder, decoder = encoder_family(config.encoder), decoder_family(config.decoder)
        stacks = {"encoder": encoder, "decoder": decoder, "__module__": __name__}
        return type(f"EncoderDecoder({encoder.__name__}, {decoder.__name__})", (type(self),), stacks)()

    def stack_config(self, config: Any, name: str) -> Any:
        return getattr(config, name)


class SpeechEncoderDecoder(EncoderDecoder):
    model_types = ("speech-encoder-decoder",)
    refused = (
        "SpeechEncoderDecoderModel pairs a speech encoder (Wav2Vec2, HuBERT, Data2VecAudio, SEW, UniSpeech, ...: "
        "convolutions over the raw waveform, a convolutional position embedding, then attention blocks) with a text "
        "decoder; attnlens has no family for any of those encoders yet (their attention blocks are BART-like, but "
        "their feature encoder, convolutional positions and stable-layer-norm layouts are not described), so it "
        "cannot compose the pair as it composes EncoderDecoderModel's"
    )


class ProphetNet(EncoderDecoder):
    model_types = ("prophetnet", "xlm-prophetnet")
    refused = (
        "ProphetNet's attention computes its scores and pattern inline (einsum in ProphetNetAttention.forward, not "
        "through the attention interface attnlens reads), and its decoder's n-gram self-attention "
        "(ProphetNetNgramSelfAttention) runs the main stream and config.ngram predict streams in one module, with "
        "relative position buckets added to both, on blocks whose hidden states hold all the streams concatenated "
        "([batch, (1 + ngram) * length, hidden]); attnlens has no locations for that attention yet, and no "
        "standardized layer_input of the main stream alone"
    )
