"""A family: where each standardized value lives in one architecture, its sizes, its score function, its limits.

A family is mostly data (module names and the operations where values live) plus the few functions that truly
differ. `Family` itself describes the common case, a transformers decoder whose attention calls the shared attention
interface (`attention_interface_1`) with the eager function defined in the model's own file (Llama and most
families since). A new family subclasses it, states how it differs, and registers:

    @attnlens.register
    class MyFamily(attnlens.Family):
        model_types = ("my_model",)
        mlp_norm = "pre_mlp_norm"
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from nnsight.intervention.envoy import Envoy

from .errors import UnknownFamily
from .locations import INTERFACE_CALL, Location, ModuleInput, ModuleOutput, Operation, OutputField, with_key_positions
from .locations.cache import with_cache
from .parts.eager import EagerFunction
from .parts.identities import Identities, MLPArithmetic  # noqa: F401  (re-exported: families build MLPArithmetic)
from .parts.notes import Joined, Note, tabled  # noqa: F401  (Joined re-exported: families' tables use it)
from .parts.old_spellings import PART_STEPS, OldSpelling, run_on_the_family
from .parts.scoring import ScoreFunction
from .parts.sizes import FamilyMethod, Sizes
from .parts.source import Anchored, operation_lines  # noqa: F401  (re-exported for families)
from .parts.vllm import LEGACY_VLLM, VLLMLayout
from .values import ALL_VALUES, WITH_CROSS_ATTENTION

#: The values the wrapped model's own envoy carries: a child module of that name is mounted at `E_<name>`.
MODEL_VALUES = tuple(value.name for value in ALL_VALUES if value.scope == "model")

#: The engines a family describes, and what each runs: transformers' own modules (`StandardizedTransformer`, whatever
#: its attention implementation), and vLLM's (`StandardizedVLLM`).
ENGINES = ("transformers", "vllm")


#: attnlens 0.1's name for the transformers engine.
LEGACY_ENGINE = "eager"


def engine_named(engine: str) -> str:
    """`engine` as one of ENGINES; "eager", attnlens 0.1's name for the transformers engine (whatever its attention
    implementation, sdpa included, hence the rename), is still accepted."""
    if engine == LEGACY_ENGINE:
        warnings.warn('the engine "eager" is now called "transformers"', DeprecationWarning, stacklevel=3)
        return "transformers"
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")
    return engine


if TYPE_CHECKING:
    from .parts.fused import FusedQKV

#: The sizes every tiny model shares: grouped heads (4 query, 2 key/value), three blocks, a wide initialisation so
#: patterns are far from uniform.
TINY_DEFAULTS = dict(
    num_hidden_layers=3,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
)


class Tiny(NamedTuple):
    """A recipe for a small random model of a family: the config and model classes named in `transformers`, config
    keyword arguments (`attnlens.models.tiny` merges `TINY_DEFAULTS` under them), and other layouts worth testing:
    name -> overrides on top (`"falcon:alibi"`)."""

    config: str
    model: str
    kwargs: dict
    layouts: dict[str, dict] = {}


def released_tiny(config: str, model: str, text: type[Family], vision: dict) -> Tiny:
    """The tiny recipe of a released multimodal checkpoint (`config`, `model`: the `...ForConditionalGeneration`
    transformers builds it as) whose language model is the text family `text`: its tiny text config (merged as
    `tiny_model` merges it, None unsetting a default) beside a small vision tower (`vision`), which makes the
    checkpoint the released kind; vLLM does not build it (`language_model_only`)."""
    merged = {**TINY_DEFAULTS, **text.tiny.kwargs}
    text_config = {"model_type": text.model_types[0], **{k: v for k, v in merged.items() if v is not None}}
    return Tiny(config, model, {"text_config": text_config, "vision_config": vision})


class Family(Anchored, OldSpelling):
    """The common transformers decoder layout. Override attributes and methods to describe another."""

    #: How the family's attention forms its scores and pattern (`parts.scoring`); `score_function(engine)` is it on
    #: one engine. A family that computes a step otherwise nests `class ScoreFunction(scoring.ScoreFunction)`.
    ScoreFunction: ClassVar[type[ScoreFunction]] = ScoreFunction
    #: How the family's blocks compute each value from the ones before it (`parts.identities`), for the identities
    #: and the analyses that recompute a block; a family nests `class Identities(identities.Identities)`.
    Identities: ClassVar[type[Identities]] = Identities

    #: `config.model_type` values this family serves.
    model_types: ClassVar[tuple[str, ...]] = ()

    # Module paths: from the wrapped model, from a block, from its attention, from its MLP.
    layers = "model.layers"
    embed_tokens = "model.embed_tokens"
    final_norm = "model.norm"
    attention = "self_attn"
    mlp = "mlp"
    attention_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"
    output_projection = "o_proj"
    activation = "act_fn"
    down_projection = "down_proj"

    #: Norms applied to the attention and MLP outputs before the residual add (Gemma 2 and 3), or None; without
    #: them `layer_input + attention_output == layer_mid` and `layer_mid + mlp_output == layer_output`.
    attention_post_norm: str | None = None
    mlp_post_norm: str | None = None
    #: The cross-attention of an encoder-decoder's decoder block (`encoder_attn`, renamed `cross_attn`), or None: a
    #: block that attends to its own sequence only (every other family; `support()` then lists no cross values).
    cross_attention: str | None = None
    #: The norm in front of the cross-attention (pre-norm: mBART's `encoder_attn_layer_norm`), or None.
    cross_attention_norm: str | None = None
    #: transformers' eager attention function as this family calls it (`attnlens.EagerFunction`): where it holds the
    #: masked scores and the pattern, and the values only it forms.
    eager: ClassVar[EagerFunction] = EagerFunction()
    #: Values that are views of a fused projection's split: torch refuses in-place edits of them, assignment works.
    fused_views: ClassVar[tuple[str, ...]] = ()
    #: The fused query/key/value projection and its output's layout (`attnlens.fused.FusedQKV`), or None where
    #: queries, keys and values have projections of their own. `attnlens.split_fused_qkv` splits with it.
    fused_qkv: ClassVar[FusedQKV | None] = None
    #: Why a value missing from `locations()` is missing, where the generic "has no ..." would not say enough.
    absent: ClassVar[dict[str, str]] = {
        "attention_sinks": "no sink logit: every row of the pattern sums to one",
        "attention_gate": "no output gate: the merged head outputs are the premix",
        "attention_position_bias": "no position bias: the scores are the queries' products with the keys (scaled, "
        "masked), and positions enter through the queries and keys",
        **dict.fromkeys(
            sorted(WITH_CROSS_ATTENTION),
            "no cross-attention: the block attends to its own sequence only (an encoder-decoder's decoder blocks "
            "have one: attnlens.StandardizedSeq2Seq)",
        ),
    }

    #: What `support()` says of values, as data: selector -> {value name: note}. A selector is "*" (every layer) or
    #: words that must all hold (`parts.notes.selects`): a tag of the layer (its `layer_kind`, its
    #: `config.layer_types` entry, the engine) or "!tag" for one it lacks. A note is a template formatted from the
    #: config (`"{config.logit_scale:g}"`), a function (family, config, layer) -> str or None (None: nothing said),
    #: `Joined(note)`, or None (no note: drops one a base class gave).
    #: A class's table is applied on top of what its `notes()` override (or its bases) say: a subclass's entries win.
    kind_notes: ClassVar[dict[str, dict[str, Note]]] = {}
    #: Why values are unavailable, as data, keyed as `kind_notes`; on top of the `absent` and vLLM reasons.
    kind_reasons: ClassVar[dict[str, dict[str, Note]]] = {}

    #: How to build a small random model of the family and its other layouts (`Tiny`), or None.
    tiny: ClassVar[Tiny | None] = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def score_function(self, engine: str = "transformers") -> ScoreFunction:
        """The family's score function as `engine`'s kernel computes it."""
        return self.ScoreFunction(self, engine_named(engine))

    @property
    def identities(self) -> Identities:
        """The family's identity oracle: its blocks' arithmetic between the standardized values."""
        return self.Identities(self)

    # --- where each value lives ---------------------------------------------------------------------------

    def locations(self) -> dict[str, Location]:
        """Value name -> location, in forward order. Values missing here are unavailable on the family."""
        scores, scores_anchor = self.eager.scores
        probabilities, probabilities_anchor = self.eager.probabilities
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_norm_output": ModuleOutput(self.attention_norm),
            "attention_queries": Operation((INTERFACE_CALL,), "arg", 1),
            "attention_keys": Operation((INTERFACE_CALL,), "arg", 2),
            "attention_values": Operation((INTERFACE_CALL,), "arg", 3),
            "attention_scores": Operation((INTERFACE_CALL, scores), anchor=scores_anchor),
            "attention_probabilities": Operation((INTERFACE_CALL, probabilities), anchor=probabilities_anchor),
            "attention_head_outputs": Operation((INTERFACE_CALL,), "output", 0),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput("", 0),
            **after_attention(self),
        }

    # --- layers of different kinds ---------------------------------------------------------------------------

    def layer_kind(self, config, layer: int) -> frozenset[str]:
        """Tags that set `layer`'s locations apart from another layer's: a hybrid's linear-attention layers, MoE
        layers, a config's block layout. Layers of one kind share their locations (and their load-time check)."""
        return frozenset()

    def kind_locations(self, kind: frozenset[str], config, engine: str) -> dict[str, Location]:
        """The locations of a layer of `kind` on `engine`, in forward order. Override to adjust per kind (call
        super first); `kind` must determine the result, `config` only supplies what `kind` names."""
        return self.locations() if engine == "transformers" else self.vllm.locations(self)

    def locations_for(self, config, layer: int | None, engine: str = "transformers") -> dict[str, Location]:
        """Value name -> location on `layer` (None: the model's own values, as on layer 0), in forward order.
        Values missing here are unavailable there."""
        kind = self.layer_kind(config, 0 if layer is None else layer)
        engine = engine_named(engine)
        cache = self.__dict__.setdefault("_by_kind", {})
        if (kind, engine) not in cache:
            cache[kind, engine] = with_cache(with_key_positions(self.kind_locations(kind, config, engine)))
        return cache[kind, engine]

    def path(self, role: str, engine: str = "transformers") -> str:
        """The module path of `role` ("layers", "attention", "mlp", "output_projection", ...) on `engine`: the
        attribute above, or its `vllm.names` entry in vLLM's implementation."""
        return self.vllm.names_of(self).get(role, getattr(self, role)) if engine == "vllm" else getattr(self, role)

    def renames(self, engine: str = "transformers") -> dict[str, str]:
        """nnsight's `rename=`: module names -> the standardized `layers`, `self_attn` and `mlp`."""
        renames = {self.path("layers", engine): "layers"}
        for role, standard in (("attention", "self_attn"), ("cross_attention", "cross_attn"), ("mlp", "mlp")):
            name = self.path(role, engine)
            if name and name != standard:
                renames[name] = standard
        return renames

    def notes(self, config, layer: int, engine: str = "transformers") -> dict[str, str]:
        """Value name -> what is special about it on this family and layer (shown by `support()`, which adds what
        the value's location says about it on `engine`)."""
        notes = {}
        if engine == "transformers":
            notes = dict.fromkeys(self.fused_views, "a view of the fused projection: assign it, in-place edits fail")
        score_function = self.score_function(engine)
        window = score_function.window(config, layer)
        if window is not None:
            kept = (
                "under generate the cache keeps only the window"
                if engine == "transformers"
                else "rebuilt over the whole context (zeros outside the window)"
            )
            notes["attention_probabilities"] = f"sliding window: each query sees its last {window} keys; {kept}"
        cap = score_function.softcap(config, layer)
        if cap is not None:
            notes["attention_scores"] = f"soft-capped before the mask: tanh(s / {cap}) * {cap}"
        if self.attention_post_norm is not None:
            notes["layer_mid"] = f"layer_input + {self.attention_post_norm}(attention_output): a norm follows attention"
        return notes

    # --- sizes, read off the attention module and its config -----------------------------------------------

    #: Where the attention module's sizes are read (`parts.sizes.Sizes`: attribute paths with fallbacks);
    #: `sizes.geometry(module, family)` gives the module's heads.
    sizes: ClassVar[Sizes] = Sizes()

    # --- what cannot be read, and why --------------------------------------------------------------------------

    def unavailable(self, config, layer: int, engine: str = "transformers") -> dict[str, str]:
        """Value name -> why `layer` cannot serve it on `engine`, for a model of `config`. Called before anything
        runs. A value missing from the layer's locations gets the family's `absent` reason; one the family has but
        vLLM's implementation lacks gets `vllm.unavailable`'s."""
        reasons = {}
        implementation = getattr(config, "_attn_implementation", "eager")
        if engine == "transformers" and implementation != "eager":
            crossed = [f"cross_{name}" for name in self.eager.only] if self.cross_attention else []
            for name in (*self.eager.only, *crossed):
                reasons[name] = (
                    f"read inside transformers' eager attention function, but this model runs "
                    f"{implementation!r}, which never forms it; load with attn_implementation='eager'"
                )
        family_has = self.locations_for(config, layer)
        here = self.locations_for(config, layer, engine)
        for value in ALL_VALUES:
            if value.name in reasons:
                continue
            if value.name not in family_has:
                reasons[value.name] = (
                    self.absent.get(value.name)
                    or Family.absent.get(value.name)
                    or f"the {self.name} family has no {value.name.replace('_', ' ')}"
                )
            elif value.name not in here:
                reasons[value.name] = (
                    self.vllm.unavailable.get(value.name) or "not read by attnlens's vLLM backend on this family"
                )
        return reasons

    #: Why left padding changes this family's values (positions counted from the padded start, a recurrence run over
    #: the padding), or None: batched runs then put only prompts of one length in a forward.
    padding_changes_values: ClassVar[str | None] = None

    #: Where the values live in vLLM's implementation of the family, and what vLLM needs to run it (`VLLMLayout`):
    #: one value with every vLLM fact. vLLM keeps transformers' module names for the common layout, so the default
    #: reuses the paths above. A subclass serving other model types states its own (`replace(Parent.vllm, ...)`).
    vllm: ClassVar[VLLMLayout]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for part, steps in PART_STEPS.items():
            setattr(cls, part, composed(cls, part, steps))
        for klass in cls.__mro__:  # the class, and mixins of its (SinkScale) that are no Family themselves
            for method, table in (("notes", "kind_notes"), ("unavailable", "kind_reasons")):
                if table in vars(klass) and not getattr(vars(klass).get(method), "tabled", False):
                    setattr(klass, method, tabled(klass, method, table))
        if (isinstance(vars(cls).get("tiny"), tuple) and not isinstance(cls.tiny, Tiny)) or "tiny_layouts" in vars(cls):
            # attnlens 0.1's spelling: a plain (config, model, kwargs) tuple, and `tiny_layouts` beside it
            recipe = cls.tiny
            cls.tiny = None if recipe is None else Tiny(*recipe[:3], layouts=vars(cls).get("tiny_layouts", {}))
        methods = [size.name for size in fields(Sizes) if size.name in vars(cls)]
        if methods:  # attnlens 0.1's spelling: a method per size
            cls.sizes = replace(cls.sizes, **{name: (FamilyMethod(name),) for name in methods})
        moved: dict[str, dict[str, object]] = {}  # attnlens 0.1's spellings: one member holds each fact now
        for old, (holder, field) in MOVED.items():
            if old in vars(cls):
                moved.setdefault(holder, {})[field] = vars(cls)[old]
        for holder, facts in moved.items():
            olds = [old for old, (where, _) in MOVED.items() if where == holder and old in vars(cls)]
            held = getattr(cls, holder)
            warnings.warn(
                f"{cls.__name__}: {', '.join(olds)} {'is' if len(olds) == 1 else 'are'} deprecated; state "
                f"{holder} = {type(held).__name__}({', '.join(f'{k}=...' for k in facts)}) instead",
                DeprecationWarning,
                stacklevel=2,
            )
            setattr(cls, holder, replace(held, **facts))
        if (
            "vllm" not in moved
            and "model_types" in vars(cls)
            and "vllm" not in vars(cls)
            and cls.vllm.refusal is not None
        ):
            # A refusal speaks for the model types of the family that states it: a subclass serving types of its
            # own inherits the parent's layout (unchecked for its types) but not the parent's reason.
            cls.vllm = replace(cls.vllm, refusal=None)


Family.vllm = VLLMLayout()

#: attnlens 0.1's class attributes -> (the member that holds the fact now, its field there).
MOVED = {
    **{f"vllm_{old}": ("vllm", new) for old, new in LEGACY_VLLM.items()},
    "scores_operation": ("eager", "scores"),
    "probabilities_operation": ("eager", "probabilities"),
    "eager_only": ("eager", "only"),
}


def after_attention(family: Family, **replaced: Location) -> dict[str, Location]:
    """The locations from `layer_mid` to `logits` of the common block on `family`'s module paths, some `replaced`:
    families that spell out their own attention locations end with these."""
    tail = {
        "layer_mid": ModuleInput(family.mlp_norm),
        "mlp_norm_output": ModuleOutput(family.mlp_norm),
        "mlp_input": ModuleInput(family.mlp),
        "mlp_activation": ModuleOutput(family.activation),
        "mlp_neurons": ModuleInput(family.down_projection),
        "mlp_output": ModuleOutput(),
        "layer_output": ModuleOutput("", 0),
        "final_norm_output": ModuleOutput(family.final_norm),
        "logits": OutputField("logits"),  # after any final soft-cap, as the caller receives them
    }
    return {**tail, **replaced}


def composed(cls: type, part: str, steps: tuple[str, ...]) -> type:
    """`cls`'s `part` ("ScoreFunction" or "Identities"): its own nested class (where it states one) before its bases'
    (a mixin's, a parent family's), so a step it overrides wins and `super()` reaches the one it would have had. Steps
    written as methods of the family itself (attnlens 0.1's spelling) are folded in with a warning."""
    own = vars(cls).get(part)
    legacy = {name: vars(cls)[name] for name in steps if name in vars(cls)}
    if legacy:
        warnings.warn(
            f"{cls.__name__}: {', '.join(legacy)} as methods of the family are deprecated; state them in a nested "
            f"class {part}(attnlens.{part}) instead",
            DeprecationWarning,
            stacklevel=3,
        )
        base = own or getattr(super(cls, cls), part)
        own = type(part, (base,), {name: run_on_the_family(step) for name, step in legacy.items()})
    candidates = [own] if own is not None else []
    candidates += [getattr(base, part) for base in cls.__bases__ if hasattr(base, part)]
    unique = [c for i, c in enumerate(candidates) if c not in candidates[:i]]
    kept = tuple(c for c in unique if not any(other is not c and issubclass(other, c) for other in unique))
    if len(kept) == 1:
        return kept[0]
    return type(part, kept, {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}.{part}"})


def block_list(model: torch.nn.Module, *, any_depth: bool = False) -> str | None:
    """The path of the model's list of blocks: a ModuleList as long as the text config's `num_hidden_layers` (the
    decoder's where several are); where the config gives no depth (Blt's), or `any_depth` and no list has it (the
    survey's look at blocks that hold several sub-layers each: HRM, LongCat-Flash), the first list of two or more
    blocks of one class, the decoder's first. None where there is none."""
    depth = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    try:
        decoder = {id(m) for m in model.get_decoder().modules()}
    except Exception:  # noqa: BLE001  (no decoder to prefer)
        decoder = set()
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    uniform = [(name, m) for name, m in lists if len(m) >= 2 and len({type(block) for block in m}) == 1]
    fit = [(name, m) for name, m in lists if len(m) == depth] if depth is not None else uniform
    if not fit and any_depth:
        fit = uniform
    ranked = [name for name, m in fit if id(m) in decoder] + [name for name, _ in fit]
    return ranked[0] if ranked else None


#: The family's members that are module paths: from the wrapped model (the first three), from a block, from its
#: attention (`output_projection`), from its MLP (`activation`, `down_projection`).
MODULE_PATHS = (
    "layers",
    "embed_tokens",
    "final_norm",
    "attention",
    "mlp",
    "attention_norm",
    "mlp_norm",
    "attention_post_norm",
    "mlp_post_norm",
    "cross_attention",
    "cross_attention_norm",
    "output_projection",
    "activation",
    "down_projection",
)
MODEL_PATHS = MODULE_PATHS[:3]


def headless(model: torch.nn.Module) -> bool:
    """Whether `model` is a base model without a head (`BertModel`, `LlamaModel`: the class `AutoModel` builds for its
    config): its output holds hidden states. A class transformers registers with a head too is not one (Llama 4's
    `Llama4ForConditionalGeneration`, which `AutoModel` builds as well)."""
    from transformers.models.auto import modeling_auto

    model_type = getattr(model.config, "model_type", None)

    def named(registry) -> tuple[str, ...]:
        names = registry.get(model_type, ())
        return (names,) if isinstance(names, str) else tuple(names)

    with_head = named(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with_head += named(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    name = type(model).__name__
    return name in named(modeling_auto.MODEL_MAPPING_NAMES) and name not in with_head


def rebased(family: Family, model: torch.nn.Module) -> Family:
    """`family` on `model`: where `model` is a base model without its head (`BertModel` where the family names the
    paths of `BertForMaskedLM`, under `bert.`), its paths from the model with that prefix dropped (on the instance)."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    if not headless(model):
        return family
    family = copy.copy(family)  # an instance the caller passed may serve other models too
    family.__dict__.pop("_by_kind", None)  # locations kept per kind were made with the head model's paths
    if not hasattr(model, prefix[:-1]):
        vars(family).update(base_model_paths(family, prefix))
    return family


def base_model_paths(family: Family | type[Family], prefix: str) -> dict[str, str]:
    """`family`'s model paths (`MODEL_PATHS`) that start with `prefix` (the head model's `bert.`), as the base model
    under it has them: member -> path from the base model."""
    paths = {}
    for member in MODEL_PATHS:
        path = getattr(family, member)
        if isinstance(path, str) and path.startswith(prefix):
            path = path[len(prefix) :]
            if path.split(".")[0] in MODEL_VALUES:  # nnsight mounts a child named as a model value elsewhere
                path = Envoy.OVERLOAD_PREFIX + path
            paths[member] = path
    return paths


def final_softcap(model) -> float | None:
    """The soft-cap on a served model's final logits (`tanh(x / cap) * cap`), or None: its text config's, under either
    name transformers' configs give it (RecurrentGemma's `logits_soft_cap`), unless its family says the model returns
    its logits uncapped (`uncapped_logits(model)`: transformers 5.19's PaliGemma, whatever its Gemma 2 config says)."""
    config = model.config
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    cap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
    uncapped = getattr(model.family, "uncapped_logits", None)
    return None if uncapped is not None and uncapped(model) else cap


def token_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that embeds the tokens: `get_input_embeddings()`, else (a model that defines none) its one
    `Embedding` as long as the vocabulary; None where there is no such one."""
    try:
        return model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        vocab = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
        found = [m for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.num_embeddings == vocab]
        return found[0] if len(found) == 1 else None


class UnknownLayout(Family):
    """What attnlens serves on a model whose family it does not know: the block inputs and outputs, the embeddings
    and the logits, found from the model's structure. Every other value is unavailable with a reason saying how to
    add the family (and, where given, why the common layout was refused: `refusal`)."""

    def __init__(self, model: torch.nn.Module, refusal: str = ""):
        self.model_type = model.config.model_type
        self.refusal = refusal
        depth = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
        names = {id(m): n for n, m in model.named_modules()}
        self.layers = block_list(model)
        if self.layers is None:
            raise UnknownFamily(
                f"attnlens has no family for model type {self.model_type!r} and found no list of "
                f"{depth or 'several'} blocks in it; add the family (docs/extending.md)"
            )
        self.depth_given = depth is not None
        embeddings = token_embeddings(model)
        self.embed_tokens = names.get(id(embeddings))
        #: Why the input embeddings have no one output (None: they have): a container the forward never calls.
        self.embeddings_not_run = None
        if self.embed_tokens and type(embeddings).forward is torch.nn.Module.forward:
            self.embeddings_not_run = (
                f"the input embeddings ({self.embed_tokens}) are a {type(embeddings).__name__} of "
                f"{len(list(embeddings.children()))} modules that never runs as one module (the forward calls each "
                f"and combines their outputs), so there is no one output to read; read layers[0].layer_input"
            )
        #: Why the blocks may not run once each per forward (None: they do, or nothing says otherwise).
        self.blocks_not_once: str | None = None
        #: What kind of model it is where it is no plain decoder with attention (an encoder, attention-free), or None.
        self.kind: str | None = None
        #: Value name -> how its tensor's layout differs from docs/values.md here (seen on one forward at load).
        self.layouts: dict[str, str] = {}
        #: Why the model's output has no logits to serve (None: it has), seen on the same forward.
        self.no_logits: str | None = None

    @property
    def name(self) -> str:
        return f"unknown ({self.model_type})"

    def locations(self):
        served = self.embed_tokens and not self.embeddings_not_run
        found = {"embeddings": ModuleOutput(self.embed_tokens)} if served else {}
        if self.blocks_not_once is None:
            found.update(layer_input=ModuleInput(), layer_output=ModuleOutput("", 0))
        return found if self.no_logits else {**found, "logits": OutputField("logits")}

    def notes(self, config, layer, engine="transformers"):
        notes = dict(self.layouts)
        if not self.depth_given:
            blocks = (
                f"the blocks of {self.layers}: the config gives no num_hidden_layers, so these are the first "
                f"list of blocks of one class"
            )
            notes["layer_input"] = "; ".join(filter(None, (blocks, notes.get("layer_input"))))
        return notes

    def unavailable(self, config, layer, engine="transformers"):
        reason = (
            f"attnlens has no family for model type {self.model_type!r}"
            + (f" ({self.kind})" if self.kind else "")
            + (f", and the common layout was refused ({self.refusal})" if self.refusal else "")
            + "; subclass attnlens.Family with this model's module names and register it (docs/extending.md)"
        )
        blocks = dict.fromkeys(("layer_input", "layer_output"), self.blocks_not_once) if self.blocks_not_once else {}
        embeddings = {"embeddings": self.embeddings_not_run} if self.embeddings_not_run else {}
        logits = {"logits": self.no_logits} if self.no_logits else {}
        return {
            **{value.name: reason for value in ALL_VALUES if value.name not in self.locations()},
            **blocks,
            **embeddings,
            **logits,
        }

    def verify(self, model, layer, layer_module, attention_module):
        pass


class RefusedEncoder:
    """An encoder attnlens knows and does not serve: its `model_types`, and why (`refused`: what its blocks do that no
    family here reproduces). `StandardizedEncoder` loads such a model as one without a family, its kind said with the
    reason: the block inputs and outputs where the model's structure shows a list of blocks, every other value raising
    `Unavailable` with it (and, with no list of blocks to find, refuses it at load with it)."""

    model_types: ClassVar[tuple[str, ...]] = ()
    refused: ClassVar[str] = ""


class EncoderDecoder:
    """The family of an encoder-decoder: a `Family` for each stack, with its paths from that stack's module, and where
    each stack's module is in the model (`stacks`, nnsight paths from the head model). The decoder's family names the
    cross-attention (`Family.cross_attention`) and reads the logits (on the model)."""

    #: `config.model_type` values this family serves.
    model_types: ClassVar[tuple[str, ...]] = ()
    encoder: ClassVar[type[Family]]
    decoder: ClassVar[type[Family]]
    #: Each stack's module in the head model (`BartForConditionalGeneration`: `model.encoder`).
    stacks: ClassVar[dict[str, str]] = {"encoder": "model.encoder", "decoder": "model.decoder"}
    #: How to build a small random model of the family (`Tiny`), or None.
    tiny: ClassVar[Tiny | None] = None
    #: Generation settings the tiny model needs to `generate` (Pop2Piano's composer tokens), set on its
    #: `generation_config`.
    tiny_generation: ClassVar[dict[str, Any]] = {}
    #: A speech encoder's input in time (`StandardizedSeq2Seq.positions`): the axis of time (the last of Whisper's
    #: `input_features` [batch, mel bins, frames]; Speech2Text's are [batch, frames, features]), the seconds between
    #: two steps along it (Whisper's 10 ms frames; SpeechT5's 16 kHz samples), and the module, under the encoder's,
    #: whose convolutions step over it ("": the encoder's every convolution; SpeechT5's prenet also convolves its
    #: positions, a convolution that keeps their count).
    time_axis: ClassVar[int] = -1
    hop_seconds: ClassVar[float] = 0.01
    time_convolutions: ClassVar[str] = ""
    #: Why attnlens does not serve `model_types` (what their attention does that no family here reproduces), where
    #: the class only records that: `StandardizedSeq2Seq` refuses them with it.
    refused: ClassVar[str | None] = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def refusal(self, model: Any) -> str | None:
        """Why `StandardizedSeq2Seq` does not serve this model object of the family's types (a class of the type
        whose stacks the family does not describe: SeamlessM4T's speech-to-text model), or None: it does."""
        return None

    def stack(self, name: str) -> Family:
        """A new instance of stack `name`'s family."""
        return getattr(self, name)()

    def composed(self, config: Any) -> EncoderDecoder:
        """The family of a model of `config`: this one, whose stacks are the same on every model of its types (BART,
        T5). An encoder-decoder of any two models (`EncoderDecoderModel`) composes it from its sub-configs' types, and
        raises `UnknownFamily` saying why where it cannot."""
        return self

    def stack_config(self, config: Any, name: str) -> Any:
        """The config stack `name`'s family reads (its score function, sizes, reasons): the model's, unless each stack
        has one of its own (`EncoderDecoderModel`'s `config.encoder` and `config.decoder`)."""
        return config

    def renames(self) -> dict[str, Any]:
        """nnsight's `rename=`: each stack mounted as `encoder` / `decoder` on the model, its blocks as `layers`, and
        the blocks' sublayers under the standardized names."""
        renames: dict[str, Any] = {}
        for name, path in self.stacks.items():
            family = self.stack(name)
            if path != name:
                renames[path] = name
            if family.layers != "layers":
                renames[f"{path}.{family.layers}"] = f"{path}.layers"
            renames.update({k: v for k, v in family.renames().items() if k != family.layers})
        return renames
