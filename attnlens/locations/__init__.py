"""Where a value lives in a forward pass, and how to read and write it there through nnsight.

A location is resolved against an envoy (the model, a block, its attention or its MLP). Reading returns the tensor the
forward holds, so in-place edits land; writing replaces that one value for the rest of the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from greenlet import getcurrent
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.source import STATE as NNSIGHT_STATE

#: nnsight's name for the call of transformers' shared attention interface inside an attention forward (its
#: `attention_interface_0` is the assignment that picks the function).
INTERFACE_CALL = "attention_interface_1"


class Context(Protocol):
    """What a location may ask of the engine it reads for (the model's `attnlens.access.Access` implements it): the
    layer an envoy sits in, that layer's heads, the tokens the running forward has seen, and copies handed out."""

    tokens_seen: int | None
    #: (envoy path, operation name) -> (its module's nnsight state, the operation's envoy): `operation`.
    operations: dict

    def layer_of(self, envoy: Any) -> int: ...

    def geometry(self, layer: int) -> Any: ...

    def guard(self, tensor: Any, name: str, layer: int | None, why: str) -> Any: ...


def context(envoy) -> Context:
    """The engine's context of the model `envoy` belongs to: attached to nnsight's interleaver when the engine loads
    (`attach`), so a location reaches it from any envoy of the model, in the client and in vLLM's worker alike."""
    return envoy.interleaver.attnlens.of(envoy)


def attach(interleaver, found: Context) -> None:
    interleaver.attnlens = found


def mediator():
    """The nnsight mediator running the current trace body (None outside one)."""
    reference = getattr(getcurrent(), "mediator", None)
    return reference() if reference is not None else None


def child(envoy, path: str):
    """The envoy at the dotted `path` below `envoy` (`""`: itself); digits index a module list."""
    if not path:  # most locations sit on the envoy itself; this runs on every read
        return envoy
    for part in filter(None, path.split(".")):
        moved = Envoy.OVERLOAD_PREFIX + part  # a child named as an attribute of its envoy's class (`embeddings`)
        envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, moved if moved in envoy.__dict__ else part)
    return envoy


def submodule(module, path: str):
    """The module at the dotted envoy `path` below `module` (`child`'s path on the modules themselves): nnsight's
    envoys call a module named as one of their attributes (`output`) `E_output`."""
    for part in filter(None, path.split(".")):
        if part.startswith(Envoy.OVERLOAD_PREFIX) and not hasattr(module, part):
            part = part[len(Envoy.OVERLOAD_PREFIX) :]
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def operation(envoy, name: str):
    """The operation `envoy.source.<name>` of a module's own forward, made once per envoy and module (kept by the
    engine's context): nnsight builds a new `Source` and operation envoy on every `.source`, about 2 us on most reads,
    and the operation is only an address (its path), the same in every run. Made again where the module's nnsight
    state is new (real weights dispatched under the envoy, a module replaced): `.source` instruments that module."""
    made = context(envoy).operations
    key = envoy.path, name
    found = made.get(key)
    if found is None or found[0] is not envoy._module.__dict__.get(NNSIGHT_STATE):
        op = getattr(envoy.source, name)  # instruments the module's forward where it is not yet
        found = made[key] = envoy._module.__dict__.get(NNSIGHT_STATE), op
    return found[1]


def _replace_item(container: Any, index: int, value: Any) -> Any:
    items = list(container)
    items[index] = value
    return type(container)(items) if isinstance(container, tuple) else items


@dataclass(frozen=True)
class Location:
    """Base class; `key` identifies the handoff point, so values sharing one get the same forward rank."""

    #: What `support()` says of a value read here, beside the family's note ("" for nothing).
    note = ""
    #: Whether an in-place edit of what `read` returns reaches the model (False: it is a copy, or discarded).
    in_place = True
    #: Why an in-place edit or an assignment here cannot reach the model, where one cannot.
    why_not = ""

    @property
    def key(self) -> str:
        raise NotImplementedError

    @property
    def writable(self) -> bool:
        """Whether assigning the value reaches the model (a kind that never does says `writable = False`)."""
        return True

    def read(self, envoy) -> Any:
        raise NotImplementedError

    def write(self, envoy, value: Any) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class ModuleOutput(Location):
    """A submodule's output (`module=""` is the envoy's own), or one item of a tuple output."""

    module: str = ""
    item: int | None = None

    @property
    def key(self) -> str:
        return f"{self.module}.output"

    def read(self, envoy):
        output = child(envoy, self.module).output
        return output[self.item] if self.item is not None and isinstance(output, (tuple, list)) else output

    def write(self, envoy, value):
        target = child(envoy, self.module)
        if self.item is None:
            target.output = value
            return
        output = target.output
        target.output = _replace_item(output, self.item, value) if isinstance(output, (tuple, list)) else value


@dataclass(frozen=True)
class OutputField(Location):
    """A field of a module's output object (`logits` of a `CausalLMOutputWithPast`): what the caller receives."""

    field: str
    module: str = ""

    @property
    def key(self) -> str:
        return f"{self.module}.output"

    def read(self, envoy):
        return getattr(child(envoy, self.module).output, self.field)

    def write(self, envoy, value):
        target = child(envoy, self.module)
        output = target.output
        setattr(output, self.field, value)
        target.output = output


@dataclass(frozen=True)
class ModuleInput(Location):
    """A submodule's first input (its first positional argument, else its first keyword argument)."""

    module: str = ""

    @property
    def key(self) -> str:
        return f"{self.module}.input"

    def read(self, envoy):
        return child(envoy, self.module).input

    def write(self, envoy, value):
        child(envoy, self.module).input = value


@dataclass(frozen=True)
class ModuleArgument(Location):
    """Positional argument `index` of the submodule at `module` (else its keyword `hidden_states`): a vLLM block
    called as `layer(positions, hidden_states[, residual])`, a block argument transformers passes positionally."""

    module: str = ""
    index: int = 0

    @property
    def key(self) -> str:
        return f"{self.module}.input"

    def read(self, envoy):
        args, kwargs = child(envoy, self.module).inputs
        return args[self.index] if len(args) > self.index else kwargs["hidden_states"]

    def write(self, envoy, value):
        target = child(envoy, self.module)
        args, kwargs = target.inputs
        if len(args) > self.index:
            args = (*args[: self.index], value, *args[self.index + 1 :])
        else:
            kwargs = {**kwargs, "hidden_states": value}
        target.inputs = (tuple(args), kwargs)


@dataclass(frozen=True)
class Operation(Location):
    """An operation inside a forward, reached through nnsight's `.source`.

    `path` names the operation and the calls drilled into on the way, outermost first:
    `("attention_interface_1", "attn_weights_1")` is the assignment `attn_weights_1` inside the function that the
    call `attention_interface_1` runs. `part` is `"output"` (optionally one `item` of it), `"arg"` (positional
    argument `item`) or `"kwarg"` (keyword argument `item`: T5's `position_bias`). `anchor` is text the operation's
    source line must contain; it is checked when a model loads, so a renumbered operation fails loudly instead of
    serving another tensor.
    """

    path: tuple[str, ...]
    part: str = "output"
    item: int | str | None = None
    anchor: str = ""
    module: str = ""

    @property
    def key(self) -> str:
        return f"{self.module}.source.{'.source.'.join(self.path)}.{'output' if self.part == 'output' else 'input'}"

    def op(self, envoy):
        op = operation(child(envoy, self.module), self.path[0])
        for name in self.path[1:]:  # a called function's operations: nnsight resolves them afresh in each run
            op = getattr(op.source, name)
        return op

    def read(self, envoy):
        op = self.op(envoy)
        if self.part != "output":
            args, kwargs = op.inputs
            return kwargs[self.item] if self.part == "kwarg" else args[self.item]
        output = op.output
        return output if self.item is None else output[self.item]

    def write(self, envoy, value):
        op = self.op(envoy)
        if self.part == "kwarg":
            args, kwargs = op.inputs
            op.inputs = (args, {**kwargs, self.item: value})
        elif self.part == "arg":
            assert isinstance(self.item, int)  # an argument is read by position
            args, kwargs = op.inputs
            op.inputs = (_replace_item(args, self.item, value), kwargs)
        elif self.item is None:
            op.output = value
        else:
            assert isinstance(self.item, int)  # an output is indexed by position
            op.output = _replace_item(op.output, self.item, value)


def softmax_argument(*path: str, module: str = "") -> Operation:
    """The scores as the attention's first softmax receives them, inside the calls `path` (the attention interface,
    or none where the module computes its attention itself). An encoder's batch without padding gets no mask (the
    `+ attention_mask` assignment never runs), so the softmax's argument is the scores, masked or not."""
    return Operation((*path, "nn_functional_softmax_0"), "arg", 0, anchor="softmax", module=module)


@dataclass(frozen=True)
class KeyPositions(Location):
    """Each key's position in the sequence, `[batch, key]`, for the keys read at `keys`: the last `key` positions of
    the tokens seen so far (the engine's `Access.tokens_seen`, or the keys' own count where they span the whole
    context). Labels a sliding window's columns, whose keys are only the window's."""

    keys: Location

    in_place = False
    writable = False
    why_not = "positions are derived from the keys and the tokens seen; the forward never uses them"

    @property
    def key(self) -> str:
        return self.keys.key

    def read(self, envoy):
        import torch

        keys = self.keys.read(envoy)
        count = keys.shape[2]
        total = context(envoy).tokens_seen or count
        return torch.arange(total - count, total, device=keys.device).expand(keys.shape[0], count)

    def write(self, envoy, value):
        raise NotImplementedError  # read-only: Access refuses writes first


def insert_after(locations: dict[str, Location], after: str, name: str, location: Location) -> dict[str, Location]:
    """`locations` with `name` read at `location` right after `after` (forward order is the dict's order)."""
    ordered = {}
    for present, found in locations.items():
        ordered[present] = found
        if present == after:
            ordered[name] = location
    return ordered


def with_key_positions(locations: dict[str, Location]) -> dict[str, Location]:
    """`locations` with `attention_key_positions` right after the keys: it is read where they are (Bloom binds its
    values at a later operation)."""
    keys = locations.get("attention_keys")
    if keys is None or "attention_key_positions" in locations:
        return locations
    return insert_after(locations, "attention_keys", "attention_key_positions", KeyPositions(keys))


@dataclass(frozen=True)
class Derived(Location):
    """A value computed from another location's value by a view (`view`) and written back by `unview`.

    For layouts the forward never holds as one tensor (a fused projection's slice, heads of a flattened tensor).
    `view(envoy, held)` returns the value from the tensor `source` holds (`envoy`: the value's envoy, for its sizes:
    `context(envoy).geometry(layer)`); `unview(envoy, held, new)` returns the tensor to put back at `source` so that
    the value reads `new`. Where `view` returns a view of the held tensor, in-place edits land; where it copies
    (`in_place=False`), they cannot, and attnlens refuses them. Without `unview` the value is read-only, and `why_not`
    says why to whoever assigns it. `label` names the value in messages; `note` is what `support()` says of it.

        per_head = Derived(
            ModuleInput("o_proj"),
            view=lambda envoy, held: held.unflatten(-1, (heads, -1)),  # [b, s, heads*d] -> [b, s, heads, d]
            unview=lambda envoy, held, new: new.flatten(-2),
        )
    """

    source: Location
    view: Callable[[Any, Any], Any]
    unview: Callable[[Any, Any, Any], Any] | None = None
    label: str = ""
    in_place: bool = True  #: False where `view` copies (or its result is discarded)
    note: str = ""
    why_not: str = ""

    @property
    def key(self) -> str:
        return self.source.key

    @property
    def writable(self) -> bool:
        return self.unview is not None

    def read(self, envoy):
        return self.view(envoy, self.source.read(envoy))

    def write(self, envoy, value):
        assert self.unview is not None  # access refuses an assignment where `writable` is False
        self.source.write(envoy, self.unview(envoy, self.source.read(envoy), value))
