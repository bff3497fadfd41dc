"""Models of two stacks of blocks: an encoder-decoder (T5, BART, Marian, Whisper), as `StandardizedSeq2Seq`.

Each stack is served as a decoder-only model is: a `Family` of its own (paths from the stack's module), an `Access`
of its own (`support()`, `order()`, every read and write), the same envoys (`layers[i]`, `.self_attn`, `.mlp`).
The decoder's family names its blocks' cross-attention (`Family.cross_attention`), whose values are the attention
values again on `model.decoder.layers[i].cross_attn`. One nnsight interleaver runs the whole model, so what it
attaches is `Stacks`, which hands each envoy to its stack's access; forward order runs through both stacks, the
encoder's blocks before the decoder's.

    model = attnlens.StandardizedSeq2Seq(bart, tokenizer=tokenizer)
    with model.trace(source_ids, decoder_input_ids=target_ids):
        pattern = model.encoder.layers[0].self_attn.attention_probabilities.save()
        alignment = model.decoder.layers[-1].cross_attn.attention_probabilities.save()
        logits = model.logits.save()
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from nnsight import TransformersModel

from . import verification
from .access import Access, Stacks
from .envoys import Helpful, StackEnvoy, envoy_classes, value_property
from .errors import Unavailable, UnknownFamily
from .family import EncoderDecoder
from .locations import attach
from .parts.multimodal import AudioPositions, audio_positions
from .registry import encoder_decoder_for
from .standardized import checkpoint_tokenizer, quiet_pipeline
from .support import Support
from .values import BY_NAME

#: The stacks of an encoder-decoder, in the order they run.
STACKS = ("encoder", "decoder")


def _loaded(model: Any, kwargs: dict) -> torch.nn.Module:
    """The model object: a hub name or folder loaded as a speech or text sequence-to-sequence model."""
    if isinstance(model, torch.nn.Module):
        return model
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )

    config = AutoConfig.from_pretrained(model, **{k: kwargs[k] for k in ("revision", "token") if k in kwargs})
    # a type in both registries (SeamlessM4T) loads as its text-to-text model: the one its family serves
    speech = config.model_type in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
    speech = speech and config.model_type not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    loader = AutoModelForSpeechSeq2Seq if speech else AutoModelForSeq2SeqLM
    return loader.from_pretrained(model, **{"dtype": torch.float32, **kwargs})


def refusal(config: Any) -> str | None:
    """Why `StandardizedSeq2Seq` does not serve a model of `config` (None: it does): not an encoder-decoder, or one
    attnlens has no family for."""
    if not getattr(config, "is_encoder_decoder", False):
        return (
            f"a {config.model_type} model is not an encoder-decoder (config.is_encoder_decoder is not set): serve a "
            f"decoder-only model with attnlens.StandardizedTransformer, an encoder with attnlens.StandardizedEncoder"
        )
    try:
        encoder_decoder_for(config.model_type).composed(config)
    except UnknownFamily as error:
        return str(error)
    return None


class StandardizedSeq2Seq(Helpful, TransformersModel):
    """A transformers encoder-decoder (`AutoModelForSeq2SeqLM`, `AutoModelForSpeechSeq2Seq`) under nnsight, with the
    standardized values on `encoder.layers[i]` and `decoder.layers[i]` (`.self_attn`, `.mlp`, and the decoder's
    `.cross_attn`), and the logits on the model.

    `model` is a hub name, a local folder or a model object already loaded; `family` an `EncoderDecoder` (class or
    instance) in place of the registered one. Pass the decoder's tokens as `decoder_input_ids=` to `trace` (BART
    shifts the input right where none are given); `generate` runs the encoder once and the decoder every step.
    """

    def __init__(self, model: Any, tokenizer: Any = None, family: Any = None, **kwargs: Any) -> None:
        tokenizer = checkpoint_tokenizer(model, tokenizer, kwargs)
        model = _loaded(model, kwargs)
        if not getattr(model.config, "is_encoder_decoder", False):
            raise TypeError(refusal(model.config))
        found = encoder_decoder_for(model.config.model_type) if family is None else family
        self.family: EncoderDecoder = (found() if isinstance(found, type) else found).composed(model.config)
        refused = self.family.refusal(model)
        if refused is not None:
            raise TypeError(f"attnlens does not serve this {type(model).__name__}: {refused}")
        for path in self.family.stacks.values():  # a stack of plain modules (FSMT's) reads the model's config
            stack_module = model.get_submodule(path)
            if not hasattr(stack_module, "config"):
                stack_module.config = model.config
        envoys: dict[str, type] = {}
        for name in STACKS:
            envoys.update({name: StackEnvoy, **envoy_classes(f"{name}.layers")})
        if tokenizer is None and not model.config._name_or_path:
            raise ValueError(
                "no tokenizer came with this model (a model object built in Python): pass tokenizer= (a "
                "transformers tokenizer; attnlens.models.char_tokenizer() for token ids)"
            )
        with quiet_pipeline():
            super().__init__(
                model,
                tokenizer=tokenizer,
                rename=self.family.renames(),
                envoys=envoys,
                task="text-generation",
                **kwargs,
            )
        self.stacks: dict[str, Access] = {}
        first_block = 0
        for name in STACKS:
            family, stack = self.family.stack(name), getattr(self, name)
            count = len(stack.layers)
            config = self.family.stack_config(self.config, name)
            access = Access(
                family, config, count, "transformers", self._geometry_of(name), stack=name, first_block=first_block
            )
            self.stacks[name] = access
            first_block += count + 2  # the stack's own values before and after its blocks
            stack._module.register_forward_pre_hook(self._count_tokens(access), with_kwargs=True)
        before = {getattr(self, name).path: self.stacks[name] for name in STACKS[:-1]}
        attach(self.interleaver, Stacks({**before, "": self.stacks[STACKS[-1]]}))
        for name in STACKS:  # every module path, size and operation each stack's family names, found in the model
            verification.resolve(getattr(self, name))

    def _geometry_of(self, stack: str):
        def geometry(layer: int):
            family = self.stacks[stack].family
            return family.sizes.geometry(getattr(self, stack).layers[layer].self_attn._module, family)

        return geometry

    @staticmethod
    def _count_tokens(access: Access):
        """Before each forward of a stack: how many tokens its sequence holds once it has run (the decoder's cache's,
        then this step's)."""

        def count(module, args, kwargs) -> None:
            tokens = kwargs.get("input_ids", args[0] if args else None)
            if tokens is None:
                tokens = kwargs.get("inputs_embeds")
            cache = kwargs.get("past_key_values", kwargs.get("cache"))
            cache = getattr(cache, "self_attention_cache", cache)
            seen = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
            access.tokens_seen = None if tokens is None else seen + tokens.shape[1]

        return count

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        """nnsight's count of an invoke's rows, and a speech model's audio given by its own keyword where nnsight counts
        none (Moonshine's `input_values`: nnsight knows Whisper's `input_features` only)."""
        found = super()._batch_size(*inputs, **kwargs)
        audio = kwargs.get(self._module.main_input_name)
        return audio.shape[0] if found == 0 and not inputs and isinstance(audio, torch.Tensor) else found

    @property
    def num_layers(self) -> dict[str, int]:
        """Blocks per stack."""
        return {name: access.num_layers for name, access in self.stacks.items()}

    def support(self, layer: int = 0, stack: str = "decoder") -> Support:
        """`model.decoder.support(layer)` (or `stack="encoder"`), with the model named."""
        return replace(self.stacks[stack].support(layer), model=self)

    def positions(self, input_features: Any, hop_seconds: float | None = None) -> AudioPositions:
        """Where each of the encoder's positions sits in the audio, for a speech model (Whisper, Speech2Text, SpeechT5,
        Moonshine): `start` and `end` in seconds (`attnlens.AudioPositions`), from the encoder's convolutions over the
        `input_features` frames (the `input_values` samples of a model over the waveform), `hop_seconds` apart (by
        default the family's: Whisper's feature extractor's hop_length / sampling_rate, 160 / 16000; a waveform's
        16 kHz samples, 1 / 16000). A decoder token's cross-attention row over those positions is its alignment to
        time."""
        family = self.family
        frames = torch.as_tensor(input_features).shape[family.time_axis]
        convolved = self.encoder._module.get_submodule(family.time_convolutions)
        hop = family.hop_seconds if hop_seconds is None else hop_seconds
        try:
            found = audio_positions(convolved, frames, hop)
        except ValueError as error:
            said = f"model.positions: the {family.name} encoder's positions are not derived: {error}"
            raise Unavailable(said) from error
        if found is None:
            raise Unavailable(
                f"model.positions: the {self.family.name} encoder has no convolutions over time: each of its positions "
                f"is one of its inputs (a token, or a frame handed over as an input embedding, as Pop2Piano's)"
            )
        return found

    logits = value_property(BY_NAME["logits"])
