"""The envoys that carry the standardized values, on both engines: the blocks, their attention and their MLP.

Each value is a property generated from the catalogue; reading and writing go through the model's `Access`
(`attnlens.locations.context(envoy)`, the same object for every envoy of a model), which checks support, order
and layout before it touches nnsight.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from nnsight.intervention.envoy import Envoy

from .access import access_of
from .errors import LocationDrift
from .geometry import HeadGeometry
from .values import ALL_VALUES, BY_NAME, HOSTS, SUBLAYER_OF, Value, closest

if TYPE_CHECKING:
    from .family import Family
    from .support import Support

#: The standardized sublayers of a block: the envoy name and the scope of the values it carries.
SUBLAYERS = {name: scope for scope, name in SUBLAYER_OF.items()}


def value_property(value: Value) -> property:
    name = value.name  # what attnlens knows it by (on `cross_attn`, not the attribute)

    def read(envoy):
        try:
            return envoy.interleaver.attnlens.read(envoy, name)  # access_of(envoy), inlined: runs on every read
        except AttributeError as error:
            raise escaped(error, "reading", envoy, name) from error

    def write(envoy, new):
        if isinstance(new, Envoy):  # nnsight mounting a submodule named after this value (Inkling 2's `mlp_input`)
            mounted = f"{Envoy.OVERLOAD_PREFIX}{value.attribute}"  # moved as nnsight moves its own names
            object.__setattr__(envoy, mounted, new)
            envoy._aliases[mounted] = value.attribute
            return
        try:
            access_of(envoy).write(envoy, name, new)
        except AttributeError as error:
            raise escaped(error, "writing", envoy, name) from error

    return property(read, write, doc=f"{value.meaning} [{value.layout}]")


def escaped(error: AttributeError, doing: str, envoy, name: str) -> RuntimeError:
    """An AttributeError from inside a value's property would make Python ask `__getattr__` for the value, whose
    error ("no attribute 'layer_input'") hides the real one: it leaves the property as a RuntimeError naming it."""
    return RuntimeError(f"{doing} {name} at {envoy.path} failed inside attnlens: {type(error).__name__}: {error}")


class Helpful:
    """An unknown attribute's error names the nearest standardized values and where they live."""

    scope = "model"

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # a mixin: the Envoy after it in the MRO has it
        except AttributeError as error:
            hint = "" if name.startswith("_") else self._hint(name)
            if not hint:
                raise
            raise AttributeError(f"{error}.{hint}") from None

    def _hint(self, name: str) -> str:
        if name in SUBLAYERS:
            return f" {name} is a block's sublayer: model.layers[i].{name}."
        misplaced = next((v for v in ALL_VALUES if v.attribute == name and v.scope != self.scope), None)
        if misplaced is not None:
            return f" {name} is read on {HOSTS[misplaced.scope]}, not on {HOSTS[self.scope]}."
        return closest(name)


class LayersEnvoy(Envoy):
    """`model.layers`: indexing checks the range (negative indices count from the end, as Python's do)."""

    def __getitem__(self, key):
        if isinstance(key, int) and not isinstance(key, bool):
            key = access_of(self).check_layer(key)
        return super().__getitem__(key)


class LayerEnvoy(Helpful, Envoy):
    """`model.layers[i]`: the block's residual-stream values, and its `self_attn`, `mlp` (and an encoder-decoder's
    decoder block's `cross_attn`), always there."""

    scope = "layer"

    def __getattr__(self, name: str):
        if name not in SUBLAYERS:
            return super().__getattr__(name)
        try:
            found = Envoy.__getattr__(self, name)
        except AttributeError:
            found = None
        # No module of that name (a block without an MLP, a decoder-only block's `cross_attn`), or None in its place
        # (a hybrid's Mamba layer): the values are still asked for here, and each raises the reason support() gives.
        return found if isinstance(found, Envoy) else ABSENT[name](self, name)


class AbsentSublayer(Helpful):
    """`layers[i].self_attn` or `layers[i].mlp` where the block has no such module: reading or writing any of its
    values raises `attnlens.Unavailable` with the reason `support()` gives, on either engine; nothing else is on it."""

    _module = None  # what callers that look for the module (the load-time checks, the identities) see

    def __init__(self, block: Envoy, name: str):
        self.interleaver, self.path, self.name = block.interleaver, f"{block.path}.{name}", name

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        access = access_of(self)
        raise AttributeError(
            f"layers[{access.layer_of(self)}] of {access.where} has no {self.name} module, so it has "
            f"no {name!r}; its standardized values raise attnlens.Unavailable (see model.support())."
            f"{self._hint(name)}"
        )

    def __repr__(self) -> str:
        return f"<no {self.name} module at {self.path}>"


def absent_property(value: Value) -> property:
    """A value of a sublayer the block lacks: the reason support() gives, or, where support() serves it, the family's
    module names are wrong."""

    def refuse(envoy, *_):
        access = access_of(envoy)
        layer = access.layer_of(envoy)
        access.location(value.name, layer)  # raises Unavailable with the reason, where there is one
        raise LocationDrift(
            f"layers[{layer}].{value.key} is served on {access.where}, but block {layer} has no "
            f"module {envoy.name}: the family's module names (attention, cross_attention, mlp) do not match the model"
        )

    return property(refuse, refuse, doc=f"{value.meaning} [{value.layout}]")


class AttentionEnvoy(Helpful, Envoy):
    """`model.layers[i].self_attn`: the attention sublayer's values and its heads' sizes."""

    scope = "attention"

    @property
    def heads(self) -> HeadGeometry:
        """The heads' sizes and scale (what the family's score function takes)."""
        access = access_of(self)
        return access.geometry(access.layer_of(self))

    num_heads = property(lambda self: self.heads.num_heads, doc="query heads")
    num_kv_heads = property(lambda self: self.heads.num_kv_heads, doc="key/value heads (before repetition)")
    head_dim = property(lambda self: self.heads.head_dim, doc="size of one head's values and outputs")
    qk_head_dim = property(lambda self: self.heads.qk_head_dim, doc="size of one head's queries and keys")
    scale = property(lambda self: self.heads.scale, doc="the factor the scores are multiplied by")


class CrossAttentionEnvoy(AttentionEnvoy):
    """`model.decoder.layers[i].cross_attn`: the cross-attention's values, under the attention values' names
    (queries from the decoder, keys and values from the encoder's output), and its heads' sizes."""

    scope = "cross_attention"


class MLPEnvoy(Helpful, Envoy):
    """`model.layers[i].mlp`: the MLP's values."""

    scope = "mlp"


#: The envoy class that carries each scope's values.
HOST_CLASSES = {
    "layer": LayerEnvoy,
    "attention": AttentionEnvoy,
    "cross_attention": CrossAttentionEnvoy,
    "mlp": MLPEnvoy,
}
for _value in ALL_VALUES:
    _host = HOST_CLASSES.get(_value.scope)
    if _host is not None:
        setattr(_host, _value.attribute, value_property(_value))

#: The stand-in for each sublayer a block lacks, with the values of its scope.
ABSENT = {
    name: type(
        f"Absent{scope.title().replace('_', '')}",
        (AbsentSublayer,),
        {"scope": scope, **{value.attribute: absent_property(value) for value in ALL_VALUES if value.scope == scope}},
    )
    for name, scope in SUBLAYERS.items()
}


def adopt_hosts(model) -> None:
    """Give each block's attention and MLP envoy its host class where nnsight chose another: a module class key wins
    over a path key, so where the MLP *is* one of vLLM's parallel layers (OPT's fc2) it got `ParallelEnvoy` alone."""
    for index in range(model.num_layers):
        block = model.layers[index]
        for name, host in (("self_attn", AttentionEnvoy), ("mlp", MLPEnvoy)):
            envoy = getattr(block, name, None)
            if isinstance(envoy, Envoy) and not isinstance(envoy, host):
                envoy.__class__ = _combined(host, envoy.__class__)


@functools.cache
def _combined(host: type, chosen: type) -> type:
    return type(f"{host.__name__[:-5]}{chosen.__name__}", (host, chosen), {})


def envoy_classes(layers: str = "layers", attention: str = "self_attn", mlp: str = "mlp") -> dict[str, type]:
    """nnsight's `envoys=` for a model whose blocks, attention and MLP have these (renamed) paths."""
    return {
        layers: LayersEnvoy,
        f"{layers}.*": LayerEnvoy,
        f"{layers}.*.{attention}": AttentionEnvoy,
        f"{layers}.*.cross_attn": CrossAttentionEnvoy,
        f"{layers}.*.{mlp}": MLPEnvoy,
    }


def add_model_values(cls: type) -> type:
    """Give a model class the model-scope values (`embeddings`, `final_norm_output`, `logits`)."""
    for value in ALL_VALUES:
        if value.scope == "model":
            setattr(cls, value.name, value_property(value))
    return cls


class StackEnvoy(Helpful, Envoy):
    """`model.encoder`, `model.decoder`, a multimodal model's `model.vision`: a stack of blocks, with its `layers`,
    its own values (`embeddings`, `final_norm_output`), `support(i)`, `order(i)` and `num_layers`, as a decoder-only
    model has them."""

    @property
    def num_layers(self) -> int:
        return access_of(self).num_layers

    @property
    def family(self) -> Family:
        """The stack's family (the decoder's names the cross-attention)."""
        return access_of(self).family

    @property
    def config(self) -> Any:
        return access_of(self).config

    def support(self, layer: int = 0) -> Support:
        """Which values block `layer` of this stack serves and, for each it doesn't, why."""
        return access_of(self).support(layer)

    def order(self, layer: int = 0) -> dict[str, int]:
        """Forward-order rank of every value of block `layer` of this stack."""
        return access_of(self).order(layer)


for _name in ("embeddings", "final_norm_output"):  # a stack's own values; the logits are the model's
    setattr(StackEnvoy, _name, value_property(BY_NAME[_name]))
