"""`support()`, `order()` and every read and write of a standardized value, for one model on one engine.

Both model classes hold an `Access` (and vLLM's worker holds one of its own, where the reads run), so what is served,
the order, the checks on writes and the error text are the same on both engines. A value is found through the
family's locations for the engine; everything here is derived from the catalogue (`values.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, cast

import torch
from nnsight.intervention.interleaver import OutOfOrderError

from .errors import AttnlensError, EditError, OrderError, OutsideTrace, Unavailable
from .family import Family, engine_named
from .geometry import HeadGeometry
from .locations import Location, cache, context, mediator
from .support import Support
from .values import ALL_VALUES, BY_KEY, BY_NAME, LAYER_VALUES, WITH_CROSS_ATTENTION, model_position


def describe(name: str, layer: int | None, stack: str = "") -> str:
    """How messages name a value: `layers[3].self_attn.attention_keys`, `logits`; in a stack of an encoder-decoder,
    `decoder.layers[3].cross_attn.attention_probabilities`."""
    named = BY_NAME[name].key if layer is None else f"layers[{layer}].{BY_NAME[name].key}"
    return f"{stack}.{named}" if stack else named


#: Ranks within one block are far below this: a (block, rank) position packs into one integer, so the order check on
#: every read compares two ints.
_RANKS = 1 << 12


class Plan(NamedTuple):
    """What a read of one value on one envoy needs, worked out on its first read: reads run per layer and per step,
    and nnsight's own handoff is the cost that should remain."""

    name: str
    layer: int | None
    location: Location
    #: `position` packed into one integer (forward order is integer order).
    order: int
    #: Why an in-place edit of what is read cannot reach the model (None: it can, the tensor is the forward's own).
    copy: str | None


class EngineMode(Protocol):
    """An engine mode that serves less than the family's locations (`Access.mode`)."""

    def reasons(self, layer: int | None) -> dict[str, str]:
        """Value name -> why this mode does not serve it on `layer` (None: the model's own values)."""
        ...

    def location(self, location: Location) -> Location:
        """`location` as this mode serves it (read-only where an edit would not reach the model)."""
        ...


class Reads:
    """What one nnsight mediator (one invoke) has read: every read in order, the last one and the step it was in."""

    __slots__ = ("last", "reads", "step")

    def __init__(self) -> None:
        self.step: int = 0
        self.last: Plan | None = None
        self.reads: list[Plan] = []


class Access:
    """What one model serves on one engine, and the one path every read and write takes."""

    def __init__(
        self,
        family: Family,
        config: Any,
        num_layers: int,
        engine: str,
        geometry: Callable[[int], HeadGeometry],
        rebuild_patterns: bool = False,
        stack: str = "",
        first_block: int = 0,
    ):
        self.family, self.config, self.num_layers = family, config, num_layers
        #: The stack of blocks this serves where the model has several (an encoder-decoder's "encoder", "decoder"),
        #: as messages name it; its blocks come after `first_block` blocks of the stacks run before it.
        self.stack, self.first_block = stack, first_block
        self.engine = engine_named(engine)
        self._geometry = geometry
        self._reasons: dict[int | None, dict[str, str]] = {}
        self._orders: dict[int, dict[str, int]] = {}
        # A read resolves its location, its place in the forward and its envoy's layer once (`Plan`).
        self._resolved: dict[tuple[str, int | None], Location] = {}
        self._positions: dict[tuple[str, int | None], tuple[int, int]] = {}
        self._layers: dict[str, int] = {}
        self._plans: dict[tuple[str, str], Plan] = {}  # (envoy path, value name) -> plan
        self.operations: dict[tuple[str, str], tuple] = {}  # see `locations.operation`
        self._rebuild_patterns = rebuild_patterns
        self._layer_path = re.compile(rf"(?:^|\.){re.escape(family.path('layers', engine))}\.(\d+)(?:\.|$)")
        #: Tensors handed out as copies during the current eager run (None: kept per request, on vLLM).
        self.run_copies: list | None = None
        #: Tokens the running forward has seen, this step's included (eager; None where keys span the context).
        self.tokens_seen: int | None = None
        #: Which image each position of the running prompt belongs to (`Positions.image`), where the family's mask
        #: lets an image's tokens see each other (None: no images, or a generation step past the prompt).
        self.image_of: torch.Tensor | None = None
        #: The running prompt's prefix that attends both ways (`ImageTokens.prefix`: PaliGemma's, from its token
        #: types), where the family's mask has one (None: none, or a generation step past the prompt).
        self.prefix: torch.Tensor | None = None
        #: Whether the running forward was given images (`multimodal.holds_images`): where the family refuses image
        #: prompts (`LanguageModelOf.refuses_images`), a block's values are refused on it.
        self.images_given = False
        #: What this engine's mode serves less than the family's locations (a vLLM engine running the compiled model:
        #: the attention op's values only, `vllm.static.CompiledMode`); None: all of them.
        self.mode: EngineMode | None = None
        #: Reasons that hold on every layer, found by the engine at load (a model that keeps no KV cache, a base model
        #: without a head and so without logits).
        self.without: dict[str, str] = {}

    def of(self, envoy) -> Access:
        """The access that serves `envoy`: this one (a model of several stacks attaches `Stacks`)."""
        return self

    def describe(self, name: str, layer: int | None) -> str:
        return describe(name, layer, self.stack)

    # --- layers ------------------------------------------------------------------------------------------------

    def check_layer(self, layer: Any) -> int:
        """`layer` as a non-negative index; negative ones count from the end, as Python's do."""
        n = self.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"a layer index is an int; got {layer!r}")
        if not -n <= layer < n:
            raise IndexError(
                f"layer {layer} is out of range: this model has {n} layers, so a layer index is in "
                f"[0, {n}), or [-{n}, -1] counting from the end"
            )
        return layer % n

    def layer_of(self, envoy) -> int:
        path = envoy.path
        if path not in self._layers:
            applied = envoy.__dict__.get("application")  # an application of a block run several times (ALBERT's)
            if applied is not None:
                self._layers[path] = applied
                return applied
            found = self._layer_path.search(path)
            if found is None:
                raise RuntimeError(f"{path} is not inside a block of {self.family.path('layers', self.engine)}")
            self._layers[path] = int(found.group(1))
        return self._layers[path]

    @property
    def where(self) -> str:
        """The family, and the engine where it is not the eager one: how error messages name the model."""
        return self.family.name if self.engine == "transformers" else f"{self.family.name} ({self.engine})"

    def geometry(self, layer: int) -> HeadGeometry:
        try:
            return self._geometry(layer)
        except AttributeError as error:  # inside a property Python would retry through Envoy.__getattr__ and hide it
            raise RuntimeError(f"the heads of layer {layer} on {self.family.name}: {error}") from error

    # --- what is served, and in what order --------------------------------------------------------------------

    @property
    def rebuild_patterns(self) -> bool:
        """Eager engine, opt-in: serve the scores and the pattern of a non-eager model rebuilt (rebuild.py)."""
        return self._rebuild_patterns

    @rebuild_patterns.setter
    def rebuild_patterns(self, value: bool) -> None:
        self._rebuild_patterns = value
        self.refresh()

    def refresh(self) -> None:
        """Forget the reasons and orders worked out so far (after the family's locations changed)."""
        self._reasons.clear()
        self._orders.clear()
        self._resolved.clear()
        self._positions.clear()
        self._plans.clear()

    def reasons(self, layer: int | None) -> dict[str, str]:
        """Value name -> why it is unavailable on `layer` (None: the model's own values)."""
        if layer not in self._reasons:
            from . import rebuild

            reasons = self.family.unavailable(self.config, 0 if layer is None else layer, self.engine)
            reasons = {**self.without, **reasons}  # the family's own reason first
            if layer is not None:  # the KV cache values: the same words on both engines (locations/cache.py)
                reasons = cache.unavailable(self.family, self.config, layer, self.engine, reasons)
            if self.rebuild_patterns and layer is not None:
                reasons = rebuild.adjust(self, layer, reasons)
            if self.mode is not None:
                reasons = {**self.mode.reasons(layer), **reasons}  # the family's own reason first
            self._reasons[layer] = reasons
        return self._reasons[layer]

    def locations(self, layer: int | None) -> dict[str, Location]:
        return self.family.locations_for(self.config, layer, self.engine)

    def location(self, name: str, layer: int | None) -> Location:
        """Where `name` is read on `layer`; `Unavailable` with the reason where it is not served."""
        found = self._resolved.get((name, layer))
        if found is None:
            reason = self.reasons(layer).get(name)
            if reason is not None:
                raise Unavailable(f"{self.describe(name, layer)} on {self.where}: {reason}")
            from . import rebuild

            found = rebuild.location(self, name, layer) or self.locations(layer)[name]
            if self.mode is not None:
                found = self.mode.location(found)
            self._resolved[name, layer] = found
        return found

    def support(self, layer: int = 0) -> Support:
        layer = self.check_layer(layer)
        reasons = self.reasons(layer)
        report = {value.key: reasons.get(value.name) for value in LAYER_VALUES}
        omitted = {}
        if self.family.cross_attention is None:  # a decoder-only block's vocabulary has no cross-attention
            omitted = {value.key: report.pop(value.key) for value in LAYER_VALUES if value.name in WITH_CROSS_ATTENTION}
        report.update(
            {value.name: self.reasons(None).get(value.name) for value in ALL_VALUES if value.scope == "model"}
        )
        notes = self.family.notes(self.config, layer, self.engine)
        for name in report:  # the location's own word on a value (a copy, a rebuilt pattern) joins the family's
            value = BY_KEY[name]  # a cross-attention key names its own value (cross_attn.attention_keys)
            if report[name] is None:
                location = self.location(value.name, None if value.scope == "model" else layer)
                said = [note for note in (notes.get(value.name), location.note) if note]
                if said:
                    notes[value.name] = "; ".join(said)
        refuses = getattr(self.family, "refuses_images", None)  # (`LanguageModelOf.refuses_images`)
        if refuses:  # read on a prompt with images, a block's value raises (`_refuse_images`)
            refused = f"refused on a prompt with images: {refuses}"
            for value in LAYER_VALUES:
                notes[value.name] = "; ".join(filter(None, (notes.get(value.name), refused)))
        keyed = {BY_NAME[name].key: note for name, note in notes.items() if name in BY_NAME}
        return Support(
            family=self.family.name,
            layer=layer,
            engine=self.engine,
            reasons=report,
            notes={key: note for key, note in keyed.items() if report.get(key) is None},
            omitted=omitted,
        )

    def order(self, layer: int = 0) -> dict[str, int]:
        """Forward-order rank of every value `layer` serves; values read at one location share a rank."""
        layer = self.check_layer(layer)
        if layer not in self._orders:
            self._orders[layer] = self._order(layer)
        return dict(self._orders[layer])

    def _order(self, layer: int) -> dict[str, int]:
        reasons = self.reasons(layer)
        ranks: dict[str, int] = {}
        keys: list[str] = []
        for name in self.locations(layer):
            value = BY_NAME[name]
            if value.scope == "model" or name in reasons:
                continue
            key = f"{value.scope}:{self.location(name, layer).key}"
            if key not in keys:
                keys.append(key)
            ranks[value.key] = keys.index(key)
        return dict(sorted(ranks.items(), key=lambda item: item[1]))

    def position(self, name: str, layer: int | None) -> tuple[int, int]:
        """Where a value falls in the whole forward: (block, rank), the model's values before and after the blocks."""
        found = self._positions.get((name, layer))
        if found is None:
            if layer is None:
                found = model_position(name, self.num_layers)
            else:
                found = (layer, self.order(layer).get(BY_NAME[name].key, -1))
            self._positions[name, layer] = found
        return found

    # --- reading and writing -------------------------------------------------------------------------------------

    def plan(self, envoy, name: str) -> Plan:
        """How `name` is read on `envoy` (a block, its attention or MLP, or the model for the model's values);
        `Unavailable` where it is not served (not kept: the reason is given on every read)."""
        found = self._plans.get((envoy.path, name))
        if found is None:
            layer = None if BY_NAME[name].scope == "model" else self.layer_of(envoy)
            location = self.location(name, layer)
            block, rank = self.position(name, layer)
            copy = None if location.in_place else location.why_not or "it is a copy of what the forward holds"
            found = Plan(name, layer, location, (self.first_block + block + 1) * _RANKS + rank + 1, copy)
            self._plans[envoy.path, name] = found
        return found

    def read(self, envoy, name: str) -> Any:
        plan = self._plans.get((envoy.path, name)) or self.plan(envoy, name)
        running = mediator()
        if running is not None:
            self._check(running, plan)
        try:  # (not a context manager: this runs on every read, and a try costs nothing until it fails)
            value = plan.location.read(envoy)
        except Exception as error:
            said = self.failure(error, plan, running, "read")
            if said is error:
                raise
            raise said from error
        self._refuse_images(plan)
        if plan.copy is not None and isinstance(value, torch.Tensor):
            value = self.guard(value, name, plan.layer, plan.copy)
        return value

    def write(self, envoy, name: str, new: Any) -> None:
        plan = self.plan(envoy, name)
        layer, location = plan.layer, plan.location
        registry = self._registry()  # assigning a value settles in-place edits of its copies: they land now
        registry[:] = [entry for entry in registry if entry[2:4] != (name, layer)]
        if not location.writable:
            why = location.why_not or "its location gives no way to write it back (a Derived value without unview)"
            raise EditError(f"{self.describe(name, layer)} is read-only on {self.where}: {why}")
        running = mediator()
        if running is not None:
            self._check(running, plan)
        try:
            old = location.read(envoy)
            self._refuse_images(plan)
            location.write(envoy, self.conform(name, layer, old, new))
        except Exception as error:
            said = self.failure(error, plan, running, "written")
            if said is error:
                raise
            raise said from error

    def _refuse_images(self, plan: Plan) -> None:
        """A block's value on a prompt with images, where the family refuses them (`LanguageModelOf.refuses_images`):
        asked once the forward reached it, when the run's inputs are known."""
        refused = getattr(self.family, "refuses_images", None) if self.images_given and plan.layer is not None else None
        if refused is not None:
            raise Unavailable(
                f"{self.describe(plan.name, plan.layer)} on {self.where}, on a prompt with images: {refused}"
            )

    def _check(self, running, plan: Plan) -> None:
        """The checks every read and write makes inside a trace: no copy handed out was edited in place, and the
        forward has not passed the value in this step."""
        state = running.__dict__
        copies = self.run_copies if self.run_copies is not None else state.get("attnlens_copies")
        if copies:
            self.check_copies(copies)
        # Refuse a value the forward computes before the one read last in this step, before nnsight is asked: it
        # would fail, or under generate serve the value from a later step.
        reads = state.get("attnlens_reads")
        if reads is None:
            reads = state["attnlens_reads"] = Reads()
        step = running.iteration
        if step is None:  # nnsight relaxes a pinned step to None once served: it is still this step
            step = reads.step
        last = reads.last
        if last is not None and step == reads.step and last.order > plan.order:
            raise OrderError(self._order_message(plan.name, plan.layer, last.name, last.layer))
        reads.step, reads.last = step, plan
        reads.reads.append(plan)

    def failure(self, error: Exception, plan: Plan, running, done: str) -> Exception:
        """What a failed read or write of `plan` raises, in attnlens's words: nnsight's out-of-order error naming the
        values, and any failure with no trace running (`running`: the mediator, None) as `OutsideTrace`; else the
        error itself."""
        if isinstance(error, OutOfOrderError):
            return self.order_error(plan) or error
        if running is None and not isinstance(error, AttnlensError):  # no trace: nnsight's words say little
            return self.outside(plan, done)
        return error

    def outside(self, plan: Plan, done: str) -> OutsideTrace:
        """A read or write outside a trace, where no forward runs to hold the value (nnsight says "`.source` is
        only available inside a trace" or the like): where to do it instead."""
        return OutsideTrace(
            f"{self.describe(plan.name, plan.layer)} is {done} inside a trace, while the forward runs: "
            f"`with model.trace(prompt):` (or `model.generate(...)`) and the read in its body, on either engine"
        )

    def order_error(self, plan: Plan) -> OrderError | None:
        """nnsight's out-of-order error, naming the values (None where it was a `tracer.iter` loop outrunning the
        run, which ends that way by design)."""
        found = mediator()
        if found is None or getattr(found, "iteration", 0) != 0:
            return None
        reads = found.__dict__.get("attnlens_reads")
        later = [read for read in reads.reads if read.order > plan.order] if reads is not None else []
        if later:
            return OrderError(self._order_message(plan.name, plan.layer, later[-1].name, later[-1].layer))
        return OrderError(
            f"{self.describe(plan.name, plan.layer)} was requested after the forward pass had computed it; read "
            f"values in forward order (model.order(layer) gives it)"
        )

    def _order_message(self, name: str, layer: int | None, other_name: str, other_layer: int | None) -> str:
        this, other = self.describe(name, layer), self.describe(other_name, other_layer)
        return (
            f"{this} was read after {other}, but the forward computes {this} first; read {this} before {other} "
            f"(model.order(layer) gives the forward order)"
        )

    # --- writes that cannot mislead -----------------------------------------------------------------------------

    def conform(self, name: str, layer: int | None, current: Any, new: Any) -> Any:
        """`new` checked against the value's layout with this run's sizes (`current`'s shape): a number fills it,
        a tensor must have exactly its shape (it is moved to its device and dtype). Nothing is reshaped."""
        if not isinstance(current, torch.Tensor):
            return new
        if isinstance(new, (int, float)) or (isinstance(new, torch.Tensor) and new.dim() == 0):
            return torch.full_like(current, float(new))
        if not isinstance(new, torch.Tensor):
            raise EditError(
                f"{self.describe(name, layer)}: write a tensor of layout {self.layout(name, layer, current)} "
                f"or a number; got {type(new).__name__}"
            )
        if tuple(new.shape) != tuple(current.shape):
            raise EditError(
                f"{self.describe(name, layer)} expects a tensor of layout "
                f"{self.layout(name, layer, current)}; got shape {list(new.shape)}."
                f"{self.shape_hint(name, layer, current, new)} Nothing was written."
            )
        return new.to(device=current.device, dtype=current.dtype)

    def layout(self, name: str, layer: int | None, current: torch.Tensor) -> str:
        axes = BY_NAME[name].axes
        if len(axes) != current.dim():  # a family whose tensor differs from the catalogue (noted in support())
            return str(list(current.shape))
        return "[" + ", ".join(f"{axis}={size}" for axis, size in zip(axes, current.shape)) + "]"

    def shape_hint(self, name: str, layer: int | None, current: torch.Tensor, new: torch.Tensor) -> str:
        have, want = list(new.shape), list(current.shape)
        axes = BY_NAME[name].axes
        if have == want[1:]:
            return " It has no batch axis: add one with new[None]."
        if layer is not None and name in ("attention_keys", "attention_values") and len(have) == len(want) > 1:
            heads = self.geometry(layer)
            if have[1] == heads.num_heads != heads.num_kv_heads:
                kv = heads.num_kv_heads  # the first query head each key/value head pairs with, in the family's order
                paired = (
                    self.family.score_function()
                    .repeat_kv(torch.arange(kv).view(1, kv, 1, 1), heads.groups)
                    .flatten()
                    .tolist()
                )
                first = [paired.index(head) for head in range(kv)]
                pick = (
                    f"::{heads.groups}"
                    if first == list(range(0, heads.num_heads, heads.groups))
                    else f":{kv}"
                    if first == list(range(kv))
                    else str(first)
                )
                return (
                    f" Layer {layer} groups its {heads.num_heads} query heads over {kv} "
                    f"key/value heads, and keys and values are read before the repetition: write "
                    f"num_kv_heads={kv} heads (of a repeated tensor, new[:, {pick}])."
                )
        if sorted(have) == sorted(want) and len(axes) == len(have):
            order = [axes[want.index(size)] if want.count(size) == 1 else "?" for size in have]
            return (
                f" It has the right sizes in another order (it looks like [{', '.join(order)}]): permute it to "
                f"[{', '.join(axes)}]."
            )
        if len(have) == len(want) - 1 and have[:-1] == want[:-2] and have[-1] == want[-2] * want[-1]:
            return (
                f" Its last axis holds {want[-2]} x {want[-1]} merged: unflatten it with "
                f"new.unflatten(-1, ({want[-2]}, {want[-1]}))."
            )
        return ""

    def guard(self, tensor: torch.Tensor, name: str, layer: int | None, why: str) -> torch.Tensor:
        """`tensor`, handed out as a copy: an in-place edit of it could not reach the model, so the next read, write
        or the end of the step raises `EditError` if one happened. An inference tensor counts no edits, so it is
        handed out as a normal one."""
        if tensor.is_inference():
            with torch.inference_mode(False):
                tensor = tensor.clone()
        self._registry().append((tensor, tensor._version, name, layer, why))
        return tensor

    def _registry(self) -> list:
        if self.run_copies is not None:
            return self.run_copies
        found = mediator()
        return found.__dict__.setdefault("attnlens_copies", []) if found is not None else []

    def gradient_error(self, message: str, registry: list) -> Unavailable | None:
        """nnsight's error for a gradient that never came, when it was asked of a tensor handed out as a copy: the
        loss never flows through it."""
        asked = re.search(r"'(\d+)\.grad", message)
        for tensor, _, name, layer, why in registry if asked else ():
            if id(tensor) == int(asked.group(1)):
                return Unavailable(
                    f"the gradient of {self.describe(name, layer)} on {self.where} is unavailable: {why}, "
                    f"computed beside the forward, so no gradient from the loss reaches it. Take the "
                    f"gradient of a value the forward uses (the queries and keys, the head outputs)"
                )
        return None

    def check_copies(self, registry: list | None = None) -> None:
        for tensor, version, name, layer, why in self._registry() if registry is None else registry:
            if tensor._version != version:
                raise EditError(
                    f"{self.describe(name, layer)} was edited in place, but on {self.where} {why}, so the edit "
                    f"could not reach the model. Assign it instead: "
                    f"`... .{name} = edited` with an edited tensor or a clone you edit."
                )


def access_of(envoy: Any) -> Access:
    """The `Access` that serves `envoy`: the `locations.Context` its engine attached (its stack's, where the model has
    several)."""
    return cast(Access, context(envoy))


class Stacks:
    """What an encoder-decoder attaches to its interleaver in place of one `Access`: one per stack of blocks, each
    serving the envoys under its stack's module (the encoder's), the last (the decoder's) the rest (the model's own
    values, its logits). Every read goes through `read`, as through an `Access`; everything else asks `of(envoy)`."""

    def __init__(self, stacks: dict[str, Access]):
        #: A stack's envoy path (`model.model.encoder`) -> its access, for it and every envoy under it; "" for the rest.
        self.stacks = stacks
        self._of: dict[str, Access] = {}

    def of(self, envoy) -> Access:
        path = envoy.path
        found = self._of.get(path)
        if found is None:
            found = next(
                access
                for stack, access in self.stacks.items()
                if not stack or path == stack or path.startswith(f"{stack}.")
            )
            self._of[path] = found
        return found

    def read(self, envoy, name: str) -> Any:  # the one call made on the attached object itself (every read)
        return self.of(envoy).read(envoy, name)
