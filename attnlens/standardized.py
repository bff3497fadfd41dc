"""`StandardizedTransformer`: any transformers causal LM, with one vocabulary for the values inside it."""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import replace
from typing import Any

import torch
from nnsight import TransformersModel
from nnsight.intervention.interleaver import OutOfOrderError

from . import applications, verification
from .access import Access, Stacks
from .envoys import Helpful, StackEnvoy, add_model_values, envoy_classes
from .errors import EditError, InferredFamilyWarning, Miswired, UnknownFamily, UnknownFamilyWarning
from .family import Family, UnknownLayout, headless, rebased
from .inputs import check_inputs
from .locations import attach
from .locations.cache import NAMES as CACHE_NAMES
from .locations.cache import NO_CACHE, kept_by
from .parts.multimodal import Positions, holds_images, prompt_positions
from .registry import family_for, refused_encoders, resolve_family
from .support import Support


def built_as_text_model(config: Any) -> bool:
    """Whether `AutoModelForCausalLM` builds a checkpoint of `config` as its text model, on the text config (a
    released Qwen3.5, Llama 4 or Qwen4-Exp checkpoint: the vision tower dropped)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    built = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return (
        built is not None
        and type(config) is not built.config_class
        and isinstance(config.get_text_config(), built.config_class)
    )


def _config(model: Any, kwargs: dict) -> Any:
    """The config of a model object, or of a checkpoint (hub name or folder)."""
    if isinstance(model, torch.nn.Module):
        return model.config
    from transformers import AutoConfig

    config_kwargs = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token") if k in kwargs}
    return AutoConfig.from_pretrained(model, **config_kwargs)


def _model_type(model: Any, kwargs: dict) -> str:
    """The model type of the model transformers builds: a checkpoint's, or its text config's where that is what
    `AutoModelForCausalLM` builds (`built_as_text_model`)."""
    if isinstance(model, torch.nn.Module):
        return model.config.model_type
    config = _config(model, kwargs)
    return config.get_text_config().model_type if built_as_text_model(config) else config.model_type


def _unknown_family_message(model_type: str, refusal: str = "", kind: str | None = None) -> str:
    return (
        f"attnlens has no family for model type {model_type!r}"
        + (f" ({kind})" if kind else "")
        + (f", and its blocks are not the common layout (check {refusal}; see docs/inferred.md)" if refusal else "")
        + ". Without one, layers[i].layer_input, "
        f"layers[i].layer_output, embeddings and logits work, and nnsight's own module paths; the attention, MLP "
        f"and norm values raise attnlens.Unavailable. To add them, subclass attnlens.Family, set "
        f"model_types = ({model_type!r},) and the module names and locations that differ, and decorate it with "
        f"@attnlens.register (docs/extending.md walks through it)."
    )


def _inferred(model: torch.nn.Module, model_type: str) -> Family:
    """The common layout inferred and verified on `model` (`attnlens.inferred`), else `UnknownLayout` naming the first
    check that failed; either warns."""
    from .inferred import Inferred, NotCommonLayout, not_a_plain_decoder

    try:
        family = Inferred(model)
    except NotCommonLayout as refusal:
        return _unknown_layout(model, model_type, str(refusal), not_a_plain_decoder(model))
    warnings.warn(family.advice(), InferredFamilyWarning, stacklevel=4)
    return family


def _unknown_layout(model: torch.nn.Module, model_type: str, refusal: str, kind: str | None) -> UnknownLayout:
    """What is served without a family (`UnknownLayout`): the block inputs and outputs, embeddings and logits, with a
    warning saying why (`refusal`: the check the common layout failed) and what kind of model it is."""
    from .inferred import blocks_run_once, layouts

    warnings.warn(_unknown_family_message(model_type, refusal, kind), UnknownFamilyWarning, stacklevel=5)
    family = UnknownLayout(model, refusal=refusal)
    family.kind = kind
    family.blocks_not_once = blocks_run_once(model, family.layers)
    family.layouts = layouts(model, family)  # what it serves, as one forward at load lays it out
    return family


def _task(model: Any) -> str:
    """The pipeline task nnsight wraps the model in: text generation for a causal LM (what a hub name or folder loads
    as), feature extraction for a model object that cannot generate (an encoder: BERT's masked LM, a classifier),
    which the text-generation pipeline refuses with a raw AttributeError."""
    generates = not isinstance(model, torch.nn.Module) or getattr(type(model), "can_generate", lambda: True)()
    return "text-generation" if generates else "feature-extraction"


@contextlib.contextmanager
def quiet_pipeline():
    """Without transformers' log that a model of a class of its own "is not supported for text-generation" (and a
    list of every class that is): nnsight builds a pipeline around every model, and attnlens serves such models."""
    logger = logging.getLogger("transformers.pipelines.base")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def checkpoint_tokenizer(model: Any, tokenizer: Any, kwargs: dict) -> Any:
    """`tokenizer`, else the checkpoint's beside its weights where `model` names one (a folder or hub name) that is
    loaded here rather than by nnsight (an encoder by its head, an encoder-decoder)."""
    if tokenizer is not None or isinstance(model, torch.nn.Module):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, **{k: kwargs[k] for k in ("revision", "token") if k in kwargs})


def _loaded(model: Any, kwargs: dict, auto: str = "AutoModelForCausalLM") -> torch.nn.Module:
    """The model object, loading a hub name or folder with transformers' `auto` class (its structure is needed to find
    the blocks)."""
    if isinstance(model, torch.nn.Module):
        return model
    import transformers

    loader_kwargs = {k: v for k, v in kwargs.items() if k not in ("task", "dispatch")}
    loader_kwargs.setdefault("dtype", torch.float32)
    return getattr(transformers, auto).from_pretrained(model, **loader_kwargs)


def _refuse_encoder_decoder(model: Any, kwargs: dict) -> None:
    """An encoder-decoder has two stacks and a cross-attention: `StandardizedSeq2Seq` serves it."""
    if isinstance(model, torch.nn.Module):
        config = model.config
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, **{k: kwargs[k] for k in ("revision", "token") if k in kwargs})
    if getattr(config, "is_encoder_decoder", False):
        raise TypeError(
            f"a {config.model_type} model is an encoder-decoder (two stacks of blocks and a cross-attention): load "
            f"it with attnlens.StandardizedSeq2Seq, which serves model.encoder.layers[i], model.decoder.layers[i] "
            f"and their .cross_attn"
        )


@add_model_values
class StandardizedTransformer(Helpful, TransformersModel):
    """A transformers causal LM under nnsight, with the standardized values on `layers[i]`, `.self_attn`, `.mlp`.

    `model` is a hub name, a local folder or a model object already loaded. `family` overrides the registered
    family for the model's type: a registered model type's name (`"llama"`), an `attnlens.Family` subclass or an
    instance. `torch_dtype=` is accepted as transformers' older spelling of `dtype=`.

    Every module path and size the family names is found in the model as it loads (`attnlens.Miswired` where one is
    not there). `verify` runs one forward on a few tokens at load that checks every served value's layout and the
    identities between them (`attnlens.verification`): None (the default) does it for a family attnlens does not
    ship (one you register or pass, one inferred from the model's structure), True for any family, False for none.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        attn_implementation: str | None = None,
        family: Family | type[Family] | str | None = None,
        rebuild_patterns: bool = False,
        verify: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if "torch_dtype" in kwargs:
            if "dtype" in kwargs:
                raise TypeError("pass dtype= or torch_dtype= (its older spelling), not both")
            kwargs["dtype"] = kwargs.pop("torch_dtype")
        _refuse_encoder_decoder(model, kwargs)
        if family is None:
            model_type = _model_type(model, kwargs)
            try:
                family = family_for(model_type)
            except UnknownFamily:
                family = None
            # a registered family may decline a checkpoint of its type built of other parts (`built_of`)
            declined = family is not None and getattr(family, "declines", lambda config: None)(_config(model, kwargs))
            if declined:
                warnings.warn(f"{family.name} declines this {model_type} checkpoint: {declined}", stacklevel=2)
            if family is None or declined:
                model = _loaded(model, kwargs)
                family = self._unknown_family(model, model_type)
        self.family: Family = resolve_family(family)
        if isinstance(model, torch.nn.Module):
            self.family = rebased(self.family, model)
        if attn_implementation is not None:
            if isinstance(model, torch.nn.Module):
                model.set_attn_implementation(attn_implementation)
            else:
                kwargs["attn_implementation"] = attn_implementation
        kwargs.setdefault("task", _task(model))  # never ask the hub to infer it
        if not isinstance(model, torch.nn.Module):
            kwargs.setdefault("dispatch", True)
            kwargs.setdefault("dtype", torch.float32)
        renames = self.family.renames("transformers")
        towers = getattr(self.family, "towers", {})
        envoys = envoy_classes()
        for name, tower in towers.items():  # mounted as model.vision, its blocks as model.vision.layers
            family = tower.family()
            renames.update({tower.path: name, f"{tower.path}.{family.layers}": f"{tower.path}.layers"})
            # its blocks' sublayers under the standard names (Qwen's `attn`): its family's renames but the blocks'
            renames.update({path: standard for path, standard in family.renames().items() if path != family.layers})
            envoys.update({name: StackEnvoy, **envoy_classes(f"{name}.layers")})
        no_tokenizer = ValueError(
            "no tokenizer came with this model (a model object built in Python, or a folder without tokenizer "
            "files): pass tokenizer= (a transformers tokenizer; attnlens.models.char_tokenizer() for token ids)"
        )
        if tokenizer is None and isinstance(model, torch.nn.Module) and not model.config._name_or_path:
            raise no_tokenizer  # nothing to load one from (transformers' pipeline would look it up by '' on the hub)
        try:
            with quiet_pipeline():
                super().__init__(model, tokenizer=tokenizer, rename=renames, envoys=envoys, **kwargs)
        except Exception as error:
            if "Impossible to guess which tokenizer" not in str(error):
                raise
            raise no_tokenizer from error
        self._refuse_direction()
        built_in = type(self.family).__module__.startswith("attnlens.families.")
        layers = verification.blocks(self._module, self.family)
        self.towers: dict[str, Access] = {}
        after_towers = 0  # the towers' blocks run before the language model's, one tower after another
        for name, tower in towers.items():
            self.towers[name] = self._tower_access(name, tower, after_towers)
            after_towers += self.towers[name].num_layers + 2
        applied = applications.mount(self)  # `layers` as the applications of blocks run several times (ALBERT's)
        self.access = Access(
            self.family,
            self.config,
            len(layers) if applied is None else len(applied),
            "transformers",
            self._geometry,
            rebuild_patterns,
            first_block=after_towers,
        )
        stacks = {getattr(self, name).path: access for name, access in self.towers.items()}
        attach(self.interleaver, Stacks({**stacks, "": self.access}) if stacks else self.access)
        if not isinstance(self.family, UnknownLayout):
            verification.resolve(self)
        for name in self.towers:
            verification.resolve(getattr(self, name))
        self.access.without = kept_by(self._module, self.family, self.config, layers)
        if headless(self._module):
            self.access.without["logits"] = (
                f"{type(self._module).__name__} is a base model without a head: its output holds hidden states, not "
                f"logits; the last block's output is layers[-1].layer_output"
            )
        self._module.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
        if (not built_in if verify is None else verify) and not isinstance(self.family, UnknownLayout):
            verification.verify(self)

    #: Whether this class serves causal attention (a decoder) or bidirectional (`StandardizedEncoder`).
    causal = True

    @staticmethod
    def _unknown_family(model: torch.nn.Module, model_type: str) -> Family:
        """The family of a model type attnlens has none for: the common layout inferred from the model, if it
        verifies (`_inferred`)."""
        return _inferred(model, model_type)

    def _refuse_direction(self) -> None:
        """A model whose family's score function attends the other way than this class serves is refused, naming the
        class that serves it (a family unknown here serves no attention value, so either class takes it)."""
        if isinstance(self.family, UnknownLayout):
            return
        causal = self.family.score_function().causal(self.config)
        if causal == self.causal:
            return
        said = f"{self.family.name}'s score function says so from its config"
        raise TypeError(
            f"this {self.config.model_type} model attends causally ({said}: a decoder, such as BERT with "
            f"is_decoder=True): serve it with attnlens.StandardizedTransformer"
            if causal
            else f"this {self.config.model_type} model attends bidirectionally ({said}: an encoder): serve it with "
            f"attnlens.StandardizedEncoder"
        )

    def _count_tokens(self, module, args, kwargs) -> None:
        """Before each forward: how many tokens the sequence holds once it has run (the cache's, then this step's)."""
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5.24 spells it `cache`
        seen = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        self.access.tokens_seen = None if tokens is None else seen + tokens.shape[1]
        images = getattr(self.family, "images", None)
        prompt = kwargs.get("input_ids", args[0] if args else None)
        # images only where the run gives a tower (or an embedder) its inputs: image token ids in a text run are text
        given = holds_images(self.family, kwargs)
        self.access.image_of = (
            images.positions(self.config, prompt, kwargs).image
            if images is not None and given and images.bidirectional and prompt is not None and not seen
            else None
        )
        self.access.prefix = images.prefix(self.config, kwargs) if images is not None and not seen else None
        self.access.images_given = given

    def _tower_access(self, name: str, tower, first_block: int) -> Access:
        """The `Access` of tower `name` (its blocks run first, nothing of it cached)."""
        family = tower.family()
        stack = getattr(self, name)
        try:
            self._module.get_submodule(f"{tower.path}.{family.layers}")
        except AttributeError:  # another tower than the family's (a LLaVA checkpoint's Pixtral tower): say which
            held = type(self._module.get_submodule(tower.path)).__name__
            other = getattr(self.family, "other_towers", {}).get(held)
            raise Miswired(
                f"family {self.family.name}: its {name} tower ({tower.path}) is a {held}, with no blocks at "
                f"{family.layers!r} where {family.name} reads them{f'; {other}' if other else ''}"
            ) from None
        count = len(stack.layers)

        def geometry(layer: int):
            return family.sizes.geometry(stack.layers[layer].self_attn._module, family)

        access = Access(
            family,
            getattr(self.config, tower.config),
            count,
            "transformers",
            geometry,
            stack=name,
            first_block=first_block,
        )
        access.without.update(dict.fromkeys(CACHE_NAMES, NO_CACHE))
        return access

    def _geometry(self, layer: int):
        module = self.layers[layer].self_attn._module
        if module is None and self.family.cross_attention:  # a cross-attention block alone (Mllama's): its heads
            module = self.layers[layer].cross_attn._module
        return self.family.sizes.geometry(module, self.family)

    # --- introspection ---------------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.access.num_layers

    @property
    def rebuild_patterns(self) -> bool:
        """Opt-in: on a non-eager model, serve the scores and the pattern rebuilt from the queries and keys."""
        return self.access.rebuild_patterns

    @rebuild_patterns.setter
    def rebuild_patterns(self, value: bool) -> None:
        self.access.rebuild_patterns = value

    def support(self, layer: int = 0) -> Support:
        """Which values `layer` serves and, for each it doesn't, why (and `.analyses`: which analyses). Answers before
        anything runs."""
        return replace(self.access.support(layer), model=self)

    def order(self, layer: int = 0) -> dict[str, int]:
        """Forward-order rank of every value of block `layer`; values read at one location share a rank."""
        return self.access.order(layer)

    def positions(self, input_ids: Any, **inputs: Any) -> Positions:
        """What each position of a prompt is: text, a special token, or an image's token with its image and its row
        and column in that image's grid (`attnlens.Positions`; `.on_grid(pattern_row, image)` puts a row of a
        pattern onto the image). Pass the inputs the trace takes (a processor's output, or its input_ids and the
        rest as keywords)."""
        return prompt_positions(self.family, self.config, input_ids, inputs)

    # --- runs ------------------------------------------------------------------------------------------------------

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        check_inputs(inputs, kwargs)
        held = getattr(self.family, "cross_attention", None)
        if (
            kwargs.get("encoder_hidden_states") is not None
            and held
            and "cross_attention_input" not in self.access.locations(0)
        ):
            # an encoder-decoder's decoder run alone (BartForCausalLM): its values are laid out for a block whose
            # cross-attention never runs, so encoder states would run it past what the family reads
            raise ValueError(
                f"encoder_hidden_states: this {self.family.name} model is served as a causal LM, its blocks' "
                f"cross-attention ({held}) never running; load the encoder-decoder with attnlens.StandardizedSeq2Seq "
                f"to trace the decoder over an encoder's output"
            )
        return super()._batch_size(*inputs, **kwargs)

    def interleave(self, *args, **kwargs):
        self.access.run_copies = []
        try:
            result = super().interleave(*args, **kwargs)
        except OutOfOrderError as error:  # a gradient asked of a copy never comes: say which value, and why
            raise (self.access.gradient_error(str(error), self.access.run_copies) or error) from error
        except RuntimeError as error:
            if self.family.fused_views and "is a view and is being modified inplace" in str(error):
                names = ", ".join(self.family.fused_views)
                raise EditError(
                    f"an in-place edit hit a view of a fused projection: on {self.family.name}, {names} is a view of "
                    f"one projection's split, which torch cannot edit in place. Assign it instead, e.g. "
                    f"`attn.attention_queries = attn.attention_queries * 0` or a clone you edit."
                ) from error
            raise
        finally:
            copies, self.access.run_copies = self.access.run_copies, None
        self.access.check_copies(copies)
        return result


#: `StandardizedEncoder`'s heads: what `head=` names -> the transformers auto class a hub name or folder loads with.
ENCODER_HEADS = {
    "masked_lm": "AutoModelForMaskedLM",
    "base": "AutoModel",
    "sequence_classification": "AutoModelForSequenceClassification",
    "token_classification": "AutoModelForTokenClassification",
}


class StandardizedEncoder(StandardizedTransformer):
    """An encoder (BERT and the families built as it is): the encoder of a masked LM, a classifier or an embedding
    model, with the same values, `support()`, `order()` and edits as a decoder, its attention bidirectional.

    `model` is a hub name or folder, loaded with the auto class of `head` (`ENCODER_HEADS`: "masked_lm", "base",
    "sequence_classification", "token_classification"), or a model object already loaded (of any head). `logits` is
    the head's output (a masked LM's vocabulary logits, a classifier's labels); a base model has none. A model whose
    family makes it causal (a BERT built with `is_decoder=True`) is a decoder: `StandardizedTransformer` serves it.
    """

    def __init__(self, model: Any, tokenizer: Any = None, head: str = "masked_lm", **kwargs: Any) -> None:
        if head not in ENCODER_HEADS:
            raise ValueError(f"head={head!r} is not an encoder head attnlens loads; one of {', '.join(ENCODER_HEADS)}")
        if not isinstance(model, torch.nn.Module):
            _refuse_encoder_decoder(model, kwargs)
            tokenizer = checkpoint_tokenizer(model, tokenizer, kwargs)
            model = _loaded(model, kwargs, ENCODER_HEADS[head])
        super().__init__(model, tokenizer=tokenizer, **kwargs)
        # nnsight left-pads a model that can generate (XLM's masked LM can); an encoder pads on the right
        if self.tokenizer is not None and self._is_causal():
            self.tokenizer.padding_side = "right"
        # an encoder runs once over its whole input: nothing is cached or generated
        self.access.without.update(dict.fromkeys(CACHE_NAMES, NO_CACHE))

    causal = False

    @staticmethod
    def _unknown_family(model: torch.nn.Module, model_type: str) -> Family:
        """An encoder's family is written by hand: attnlens infers the common layout of causal decoders only."""
        refusal = "attnlens infers the common layout of causal decoders only; an encoder's family is written by hand"
        why = refused_encoders().get(model_type)  # an encoder attnlens knows and does not serve, and why
        try:
            family = _unknown_layout(model, model_type, refusal, f"an encoder: {why}" if why else "an encoder")
        except UnknownFamily as error:  # no list of blocks to serve even their inputs and outputs
            if why is None:
                raise
            raise UnknownFamily(f"{error}: {why}") from None
        if why is not None:  # a list found in such a model is not its blocks in order: their values are refused too
            family.blocks_not_once = why
        return family
