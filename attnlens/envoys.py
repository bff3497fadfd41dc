"""The envoys that carry the standardized values, on both engines: the blocks, their attention and their MLP.

Each value is a property generated from the catalogue; reading and writing go through the model's `Access`
(`envoy.interleaver.attnlens`, the same object for every envoy of a model), which checks support, order and layout
before it touches nnsight.
"""

from __future__ import annotations

import functools

from nnsight.intervention.envoy import Envoy

from .geometry import HeadGeometry
from .values import ALL_VALUES, HOSTS, Value, closest


def value_property(value: Value) -> property:
    name, per_layer = value.name, value.scope != "model"

    def read(envoy):
        access = envoy.interleaver.attnlens
        return access.read(envoy, name, access.layer_of(envoy) if per_layer else None)

    def write(envoy, new):
        if isinstance(new, Envoy):  # nnsight mounting a submodule named after this value (Inkling 2's `mlp_input`)
            mounted = f"{Envoy.OVERLOAD_PREFIX}{name}"  # moved as nnsight moves its own names: the value stays
            object.__setattr__(envoy, mounted, new)
            envoy._aliases[mounted] = name
            return
        access = envoy.interleaver.attnlens
        access.write(envoy, name, access.layer_of(envoy) if per_layer else None, new)

    return property(read, write, doc=f"{value.meaning} [{value.layout}]")


class Helpful:
    """An unknown attribute's error names the nearest standardized values and where they live."""

    scope = "model"

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # type: ignore[misc]  # a mixin: the Envoy after it in the MRO has it
        except AttributeError as error:
            if name.startswith("_"):
                raise
            hint = closest(name)
            misplaced = next((v for v in ALL_VALUES if v.name == name and v.scope != self.scope), None)
            if misplaced is not None:
                hint = f" {name} is read on {HOSTS[misplaced.scope]}, not on {HOSTS[self.scope]}."
            if not hint:
                raise
            raise AttributeError(f"{error}.{hint}") from None


class LayersEnvoy(Envoy):
    """`model.layers`: indexing checks the range (negative indices count from the end, as Python's do)."""

    def __getitem__(self, key):
        if isinstance(key, int) and not isinstance(key, bool):
            key = self.interleaver.attnlens.check_layer(key)
        return super().__getitem__(key)


class LayerEnvoy(Helpful, Envoy):
    """`model.layers[i]`: the block's residual-stream values."""

    scope = "layer"


class AttentionEnvoy(Helpful, Envoy):
    """`model.layers[i].self_attn`: the attention sublayer's values and its heads' sizes."""

    scope = "attention"

    @property
    def heads(self) -> HeadGeometry:
        """The heads' sizes and scale (what the family's score function takes)."""
        access = self.interleaver.attnlens
        return access.geometry(access.layer_of(self))

    num_heads = property(lambda self: self.heads.num_heads, doc="query heads")
    num_kv_heads = property(lambda self: self.heads.num_kv_heads, doc="key/value heads (before repetition)")
    head_dim = property(lambda self: self.heads.head_dim, doc="size of one head's values and outputs")
    qk_head_dim = property(lambda self: self.heads.qk_head_dim, doc="size of one head's queries and keys")
    scale = property(lambda self: self.heads.scale, doc="the factor the scores are multiplied by")


class MLPEnvoy(Helpful, Envoy):
    """`model.layers[i].mlp`: the MLP's values."""

    scope = "mlp"


for _value in ALL_VALUES:
    _host = {"layer": LayerEnvoy, "attention": AttentionEnvoy, "mlp": MLPEnvoy}.get(_value.scope)
    if _host is not None:
        setattr(_host, _value.name, value_property(_value))


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
    return {layers: LayersEnvoy, f"{layers}.*": LayerEnvoy, f"{layers}.*.{attention}": AttentionEnvoy,
            f"{layers}.*.{mlp}": MLPEnvoy}


def add_model_values(cls: type) -> type:
    """Give a model class the model-scope values (`embeddings`, `final_norm_output`, `logits`)."""
    for value in ALL_VALUES:
        if value.scope == "model":
            setattr(cls, value.name, value_property(value))
    return cls
