"""`StandardizedTransformer`: any transformers causal LM, with one vocabulary for the values inside it."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from greenlet import getcurrent
from nnsight import TransformersModel
from nnsight.intervention.interleaver import OutOfOrderError

from .envoys import AttentionEnvoy, LayerEnvoy, MLPEnvoy, value_property
from .errors import EditError, OrderError, Unavailable, UnknownFamily, UnknownFamilyWarning
from . import rebuild
from .family import Family, UnknownLayout, family_for
from .support import Support
from .values import ALL_VALUES, BY_NAME, LAYER_VALUES


def _model_type(model: Any, kwargs: dict) -> str:
    if isinstance(model, torch.nn.Module):
        return model.config.model_type
    from transformers import AutoConfig

    config_kwargs = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token") if k in kwargs}
    return AutoConfig.from_pretrained(model, **config_kwargs).model_type


def _unknown_family_message(model_type: str) -> str:
    return (
        f"attnlens has no family for model type {model_type!r}. Without one, layers[i].layer_input, "
        f"layers[i].layer_output, embeddings and logits work, and nnsight's own module paths; the attention, MLP "
        f"and norm values raise attnlens.Unavailable. To add them, subclass attnlens.Family, set "
        f"model_types = ({model_type!r},) and the module names and locations that differ, and decorate it with "
        f"@attnlens.register (docs/extending.md walks through it)."
    )


def _loaded(model: Any, kwargs: dict) -> torch.nn.Module:
    """The model object, loading a hub name or folder (its structure is needed to find the blocks)."""
    if isinstance(model, torch.nn.Module):
        return model
    from transformers import AutoModelForCausalLM

    loader_kwargs = {k: v for k, v in kwargs.items() if k not in ("task", "dispatch")}
    loader_kwargs.setdefault("dtype", torch.float32)
    return AutoModelForCausalLM.from_pretrained(model, **loader_kwargs)


class StandardizedTransformer(TransformersModel):
    """A transformers causal LM under nnsight, with the standardized values on `layers[i]`, `.self_attn`, `.mlp`.

    `model` is a hub name, a local folder or a model object already loaded. `family` overrides the registered
    family for the model's type (an instance or a subclass of `attnlens.Family`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        attn_implementation: str | None = None,
        family: Family | type[Family] | None = None,
        rebuild_patterns: bool = False,
        **kwargs: Any,
    ) -> None:
        if family is None:
            model_type = _model_type(model, kwargs)
            try:
                family = family_for(model_type)
            except UnknownFamily:
                model = _loaded(model, kwargs)
                family = UnknownLayout(model)
                warnings.warn(_unknown_family_message(model_type), UnknownFamilyWarning, stacklevel=2)
        self.family: Family = family() if isinstance(family, type) else family
        if attn_implementation is not None:
            if isinstance(model, torch.nn.Module):
                model.set_attn_implementation(attn_implementation)
            else:
                kwargs["attn_implementation"] = attn_implementation
        kwargs.setdefault("task", "text-generation")  # a causal LM; never ask the hub to infer it
        if not isinstance(model, torch.nn.Module):
            kwargs.setdefault("dispatch", True)
            kwargs.setdefault("dtype", torch.float32)
        f = self.family
        envoys = {"layers.*": LayerEnvoy, "layers.*.self_attn": AttentionEnvoy, "layers.*.mlp": MLPEnvoy}
        super().__init__(model, tokenizer=tokenizer, rename=f.renames(), envoys=envoys, **kwargs)
        self._reasons_cache: dict[tuple, dict[str, str]] = {}
        #: Opt-in: on a non-eager model, serve the scores and the pattern rebuilt from the queries and keys
        #: (read-only, noted by support()); see attnlens/rebuild.py. Without it they stay unavailable.
        self.rebuild_patterns = rebuild_patterns
        self._verify()

    # --- introspection ---------------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _verify(self) -> None:
        """Check the family's operations once per kind of layer (hybrids mix attention and linear-attention layers)."""
        checked = set()
        for i, layer in enumerate(self.layers):
            attention = getattr(layer, "self_attn", None)
            attention_module = attention._module if attention is not None else None
            kind = (type(layer._module), type(attention_module), id(self.family.locations_for(self.config, i)))
            if kind not in checked:
                checked.add(kind)
                self.family.verify(self._module, i, layer._module, attention_module)

    def _check_layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"layer must be an int in [0, {self.num_layers}); got {layer!r}")
        return layer % self.num_layers

    def _reasons(self, layer: int | None) -> dict[str, str]:
        key = (layer, self.config._attn_implementation, self.rebuild_patterns)
        if key not in self._reasons_cache:
            reasons = self.family.unavailable(self._module, 0 if layer is None else layer)
            if self.rebuild_patterns and layer is not None:
                reasons = rebuild.adjust(self, layer, reasons)
            self._reasons_cache[key] = reasons
        return self._reasons_cache[key]

    def support(self, layer: int = 0) -> Support:
        """Which values `layer` serves and, for each it doesn't, why. Answers before anything runs."""
        layer = self._check_layer(layer)
        reasons = self._reasons(layer)
        report = {v.key: reasons.get(v.name) for v in LAYER_VALUES}
        report.update({v.name: reasons.get(v.name) for v in ALL_VALUES if v.scope == "model"})
        notes = {**self.family.notes(self.config, layer), **rebuild.notes(self, layer)}
        notes = {BY_NAME[name].key: note for name, note in notes.items()}
        return Support(family=self.family.name, layer=layer, reasons=report, notes=notes)

    def order(self, layer: int = 0) -> dict[str, int]:
        """Forward-order rank of every value of block `layer`; values read at one location share a rank."""
        layer = self._check_layer(layer)
        ranks: dict[str, int] = {}
        keys: list[str] = []
        for name, location in self.family.ordered_locations(self.config, layer).items():
            value = BY_NAME[name]
            if value.scope == "model":
                continue
            key = f"{value.scope}:{location.key}"
            if key not in keys:
                keys.append(key)
            ranks[value.key] = keys.index(key)
        return dict(sorted(ranks.items(), key=lambda item: item[1]))

    # --- reading and writing values ----------------------------------------------------------------------------

    def _position(self, name: str, layer: int | None) -> tuple[int, int]:
        """Where a value falls in the whole forward: (block, rank), model values before and after the blocks."""
        if layer is None:
            return (-1, 0) if name == "embeddings" else (self.num_layers, ["final_norm_output", "logits"].index(name))
        return (layer, self.order(layer)[BY_NAME[name].key])

    @staticmethod
    def _describe(name: str, layer: int | None) -> str:
        return name if layer is None else f"layers[{layer}].{BY_NAME[name].key}"

    def _read_value(self, envoy, name: str, layer: int | None):
        return self._access(name, layer, lambda location: location.read(envoy))

    def _write_value(self, envoy, name: str, layer: int | None, new) -> None:
        self._access(name, layer, lambda location: location.write(envoy, new))

    def _access(self, name: str, layer: int | None, act):
        """Refuse an unavailable value before nnsight is asked; translate nnsight's order error into ours."""
        reason = self._reasons(layer).get(name)
        if reason is not None:
            raise Unavailable(f"{self._describe(name, layer)} on {self.family.name}: {reason}")
        try:
            result = act(rebuild.location(self, name, layer) or self.family.location(name, self.config, layer))
        except OutOfOrderError as error:
            raise self._order_error(name, layer) or error
        self._log_read(name, layer)
        return result

    @staticmethod
    def _mediator():
        reference = getattr(getcurrent(), "mediator", None)
        return reference() if reference is not None else None

    def _log_read(self, name: str, layer: int | None) -> None:
        mediator = self._mediator()
        if mediator is not None:
            mediator.__dict__.setdefault("attnlens_reads", []).append((name, layer))

    def _order_error(self, name: str, layer: int | None) -> OrderError | None:
        """Name the two values when a read came after one the forward computes later (None if it was not that)."""
        mediator = self._mediator()
        if mediator is None or mediator.iteration != 0:
            return None  # a `tracer.iter` loop that outran the run ends this way by design
        position = self._position(name, layer)
        later = [(n, l) for n, l in mediator.__dict__.get("attnlens_reads", []) if self._position(n, l) > position]
        if not later:
            return OrderError(
                f"{self._describe(name, layer)} was requested after the forward pass had computed it; read values "
                f"in forward order (model.order(layer) gives it)"
            )
        other = self._describe(*later[-1])
        return OrderError(
            f"{self._describe(name, layer)} was read after {other}, but the forward computes "
            f"{self._describe(name, layer)} first; read {self._describe(name, layer)} before {other} "
            f"(model.order(layer) gives the forward order)"
        )

    def interleave(self, *args, **kwargs):
        try:
            return super().interleave(*args, **kwargs)
        except RuntimeError as error:
            if self.family.fused_views and "is a view and is being modified inplace" in str(error):
                names = ", ".join(self.family.fused_views)
                raise EditError(
                    f"an in-place edit hit a view of a fused projection: on {self.family.name}, {names} is a view of "
                    f"one projection's split, which torch cannot edit in place. Assign it instead, e.g. "
                    f"`attn.attention_queries = attn.attention_queries * 0` or a clone you edit."
                ) from error
            raise


for _value in ALL_VALUES:
    if _value.scope == "model":
        setattr(StandardizedTransformer, _value.name, value_property(_value))

# Model-scope values have no block; `value_property` asks the envoy for `_layer`.
StandardizedTransformer._layer = property(lambda self: None)
