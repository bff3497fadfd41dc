"""The envoys that carry the standardized values: the model's blocks, their attention and their MLP.

Each value is a property generated from the catalogue; reading and writing go through the model, which checks support
and order before it touches nnsight.
"""

from __future__ import annotations

from nnsight.intervention.envoy import Envoy

from .values import ALL_VALUES, Value


def value_property(value: Value) -> property:
    def read(envoy):
        return envoy.root._read_value(envoy, value.name, envoy._layer)

    def write(envoy, new):
        envoy.root._write_value(envoy, value.name, envoy._layer, new)

    return property(read, write, doc=f"{value.meaning} [{value.layout}]")


class _LayerScoped(Envoy):
    @property
    def _layer(self) -> int:
        envoy = self
        while not isinstance(envoy, LayerEnvoy):
            envoy = envoy.parent
        return int(envoy.path.rsplit(".", 1)[1])


class LayerEnvoy(_LayerScoped):
    """`model.layers[i]`: the block's residual-stream values."""


class AttentionEnvoy(_LayerScoped):
    """`model.layers[i].self_attn`: the attention sublayer's values and sizes."""

    def _sizes(self, name):
        return getattr(self.root.family, name)(self._module)

    num_heads = property(lambda self: self._sizes("num_heads"), doc="query heads")
    num_kv_heads = property(lambda self: self._sizes("num_kv_heads"), doc="key/value heads (before repetition)")
    head_dim = property(lambda self: self._sizes("head_dim"), doc="size of one head's values and outputs")
    qk_head_dim = property(lambda self: self._sizes("qk_head_dim"), doc="size of one head's queries and keys")
    scale = property(lambda self: self._sizes("scale"), doc="the factor the scores are multiplied by")


class MLPEnvoy(_LayerScoped):
    """`model.layers[i].mlp`: the MLP's values."""


for _value in ALL_VALUES:
    _host = {"layer": LayerEnvoy, "attention": AttentionEnvoy, "mlp": MLPEnvoy}.get(_value.scope)
    if _host is not None:
        setattr(_host, _value.name, value_property(_value))
