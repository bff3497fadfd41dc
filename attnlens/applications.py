"""Blocks run more than once per forward (ALBERT's shared layers): `model.layers[i]` as the i-th *application*.

A family whose blocks are one module called several times per forward says so with a method `applications(self,
config)` (not a member of `Family` itself, which keeps to the 25 members tests/test_structure.py allows; `mount` looks
for it): the module path of the block each application runs, in forward order (ALBERT:
`albert_layer_groups.{g}.albert_layers.{j}` for each of its num_hidden_layers x inner_group_num calls). `model.layers`
is then that list of applications (`Applications`), and `model.layers[i]` an envoy of the block's module
(`AppliedEnvoy`) whose every read and write, standardized or nnsight's own (`.output`, `.input`, `.inputs`, an
operation of `.source`, `.skip`), binds to the module's call that is application i, and to no other. The weights are
the module's: an edit of a weight moves every application.

How it binds (`Call.within`). nnsight counts each visit of a location in a run (its occurrence) and serves a request
at the occurrence the running mediator asks for (`Mediator.iteration`: a number, or None for the next visit of that
location). Application i runs the `call`-th call of its module M. A read on it first makes sure the forward is inside
that call: where M's input has not yet been visited `call + 1` times, it reads M's input at occurrence `call` (an
anchor, pinned); from inside the call every request is unpinned, so it binds to the next visit of its location,
which is within the call. Pinning every request to `call` would not do: an operation drilled into (`op.source`: the
softmax inside the eager attention function) is instrumented in a run only from the call on which it was first asked
for, so its occurrences do not count M's calls. A read asked after M's output has passed that call is refused
(`OrderError`), before nnsight is asked or, where nnsight bound it to a later call, after.

Blocks that are no modules (XLM's and FlauBERT's: the model keeps each block's sublayers in parallel lists,
`attentions[i]`, `layer_norm1[i]`, `ffns[i]`, `layer_norm2[i]`, and runs them in its own loop) are served the same
way. Such a family says so with a method `gathered(self, config)`: for each block, its modules by the names the
family's paths use (`{"self_attn": "transformer.attentions.0", ...}`). Block i is then a `GatheredBlock`, a module
that holds those modules and is no part of the model (nothing calls it; the model's own tree and state dict are
untouched), wrapped in an envoy whose children are nnsight's envoys of the real modules; each of them runs once per
forward, so a request needs no binding (`Once`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import OutOfOrderError

from .access import access_of
from .envoys import ABSENT, SUBLAYERS, AttentionEnvoy, LayerEnvoy, MLPEnvoy
from .errors import OrderError, Unavailable
from .locations import mediator

#: nnsight's handoffs on an envoy or an operation: what a read or write of them asks the running forward for.
REQUESTS = ("output", "input", "inputs")


@dataclass(frozen=True)
class Call:
    """Application `index` of a block run several times: the `call`-th call (from 0) of the module at `block` (an
    envoy of the wrapped model)."""

    index: int
    block: Envoy
    call: int

    def within(self, action: Callable[[], Any]) -> Any:
        """`action()` (one nnsight request, or a few of one location's), bound to this call of the block."""
        running = mediator()
        if running is None or running.interleaver is None:  # outside a trace: nnsight says what it says
            return action()
        entered, left = f"{self.block.path}.input", f"{self.block.path}.output"
        if running.occurrence(left) > self.call:
            raise self.passed()
        previous = running.iteration
        try:
            if running.occurrence(entered) <= self.call:  # not yet inside the call (or at its input): wait for it
                running.iteration = self.call
                self.block.inputs  # noqa: B018  (the anchor: a read of the call's input)
            running.iteration = None  # inside the call: each request binds to its location's next visit
            result = action()
        except OutOfOrderError as error:  # the run ended with the request unserved: the forward had passed it
            raise self.passed() from error
        finally:
            running.iteration = previous
        if running.occurrence(left) > self.call:  # served past the call: a value of a later application
            raise self.passed()
        return result

    def passed(self) -> OrderError:
        return OrderError(
            f"layers[{self.index}] (call {self.call} of {self.block.path}, a block run several times per forward) was "
            f"read after the forward had run past it; read each application's values in forward order "
            f"(model.order(layer) gives it, and layers[i] runs before layers[i + 1])"
        )


@dataclass(frozen=True)
class Once:
    """Block `index` whose modules each run once per forward (a `GatheredBlock`'s): requests need no binding."""

    index: int
    block: Envoy
    call = 0

    def within(self, action: Callable[[], Any]) -> Any:
        return action()


class GatheredBlock(torch.nn.Module):
    """One block of a model that keeps its blocks' sublayers in parallel lists (XLM's): those modules under the names
    the family's paths use. No part of the model: the model's forward runs the modules, never this."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a GatheredBlock is no module of the model: the model runs its sublayers from parallel lists itself"
        )


class GatheredEnvoy(Envoy):
    """The envoy of a `GatheredBlock`: nnsight's envoys of its modules as its children. The model never runs it, so
    it has no input or output of its own to read or set."""

    def _never_runs(self, *_: Any) -> Any:
        raise Unavailable(
            f"{self.path} is a block the model keeps as parallel lists of modules ({', '.join(self._module._modules)}"
            f"), never run as one module: it has no input or output of its own; read its standardized values "
            f"(layer_input, layer_output) or its modules' own (.self_attn.output)"
        )

    output = input = inputs = property(_never_runs, _never_runs)


def gathered_blocks(root: torch.nn.Module, family: Any) -> list[GatheredBlock] | None:
    """The blocks of `root` (the wrapped model) as its family gathers them from parallel lists (`gathered`), or None
    where its blocks are modules of their own."""
    declared = getattr(family, "gathered", None)  # a method of the families whose blocks are no modules
    if declared is None:
        return None
    return [
        GatheredBlock({name: root.get_submodule(path) for name, path in block.items()})
        for block in declared(root.config)
    ]


class Positioned:
    """An nnsight object under an application (a `Source`, an operation's envoy): its requests bound to the call."""

    __slots__ = ("_call", "_target")

    def __init__(self, target: Any, call: Call):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_call", call)

    def __getattr__(self, name: str) -> Any:
        target, call = self._target, self._call
        if name in (*REQUESTS, "source"):  # an operation's `.source` asks for the function it calls
            return positioned(call.within(lambda: getattr(target, name)), call)
        if name == "skip":
            return lambda replacement: call.within(lambda: target.skip(replacement))
        return positioned(getattr(target, name), call)

    def __setattr__(self, name: str, value: Any) -> None:
        target = self._target
        self._call.within(lambda: setattr(target, name, value))

    def __repr__(self) -> str:
        return f"<application {self._call.index} of {self._target!r}>"


def positioned(found: Any, call: Call) -> Any:
    """`found` bound to `call` where it is an nnsight object that makes requests (not a tensor, not a value)."""
    module = type(found).__module__
    return Positioned(found, call) if module.startswith("nnsight.intervention.source") else found


class AppliedEnvoy:
    """An envoy of one application of a block run several times (mixed in front of the envoy class of its role:
    `LayerEnvoy`, `AttentionEnvoy`, `MLPEnvoy`, or nnsight's `Envoy`). It carries the standardized values of that role;
    everything else is the module's own envoy's, with each request bound to the application's call."""

    def __init__(self, real: Envoy, call: Call, path: str, roles: dict[str, type]):
        # not Envoy.__init__: the module's envoy exists and is instrumented; this one only points at it
        self.__dict__.update(
            _real=real,
            _module=real._module,
            _call=call,
            _roles=roles,
            _made={},
            interleaver=real.interleaver,
            path=path,
            application=call.index,  # `Access.layer_of` reads it
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_real" not in self.__dict__:
            raise AttributeError(name)
        made = self.__dict__["_made"]
        if name in made:
            return made[name]
        try:
            found = getattr(self.__dict__["_real"], name)
        except AttributeError:
            if name in SUBLAYERS and isinstance(self, LayerEnvoy):  # no such module: its values say why, as a block's
                made[name] = ABSENT[name](self, name)
                made[name].application = self._call.index  # `Access.layer_of` reads it
                return made[name]
            raise
        if not isinstance(found, Envoy):
            return positioned(found, self._call)
        role = self._roles.get(name, Envoy)
        made[name] = applied(role)(found, self._call, f"{self.path}.{name}", {})
        return made[name]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int) and key < 0:
            key += len(self._module)
        return getattr(self, str(key))

    def __iter__(self):
        return iter([getattr(self, name) for name in self._real._child_map])

    def __repr__(self) -> str:
        if isinstance(self._call, Once):
            return f"<block {self._call.index}, gathered: {self._real.path}>"
        return f"<application {self._call.index}: call {self._call.call} of {self._real.path}>"

    @property
    def output(self) -> Any:
        return self._call.within(lambda: self._real.output)

    @output.setter
    def output(self, value: Any) -> None:
        self._call.within(lambda: setattr(self._real, "output", value))

    @property
    def input(self) -> Any:
        return self._call.within(lambda: self._real.input)

    @input.setter
    def input(self, value: Any) -> None:
        self._call.within(lambda: setattr(self._real, "input", value))

    @property
    def inputs(self) -> Any:
        return self._call.within(lambda: self._real.inputs)

    @inputs.setter
    def inputs(self, value: Any) -> None:
        self._call.within(lambda: setattr(self._real, "inputs", value))

    @property
    def source(self) -> Positioned:
        return Positioned(self._real.source, self._call)

    def skip(self, replacement: Any) -> None:
        self._call.within(lambda: self._real.skip(replacement))


@functools.cache
def applied(role: type) -> type:
    """The envoy class of an application of a module whose envoy has `role`."""
    return type(f"Applied{role.__name__}", (AppliedEnvoy, role), {"__module__": __name__})


class Applications:
    """`model.layers` where the blocks run several times per forward: application i of its block's module, as the
    family's `applications(config)` lists them. Indexing checks the range (negative indices count from the end)."""

    def __init__(self, model: Envoy, calls: list[Call | Once], roles: dict[str, type]):
        self.interleaver, self.path = model.interleaver, f"{model.path}.layers"
        self.calls = calls
        self._roles = roles
        self._made: dict[int, AppliedEnvoy] = {}

    def __len__(self) -> int:
        return len(self.calls)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return [self[index] for index in range(len(self))[key]]
        index = access_of(self).check_layer(key)
        if index not in self._made:
            call = self.calls[index]
            self._made[index] = applied(LayerEnvoy)(call.block, call, f"{self.path}.{index}", self._roles)
        return self._made[index]

    def __iter__(self):
        return iter([self[index] for index in range(len(self))])

    def __repr__(self) -> str:
        where = sorted({call.block.path for call in self.calls})
        return f"<{len(self)} applications of {', '.join(where)}>"


def calls(model, paths: tuple[str, ...]) -> list[Call | Once]:
    """Application i of the block at `paths[i]` (a path from `model`, the engine's envoy of the wrapped model): the
    how-many-th call of that module it is."""
    seen: dict[str, int] = {}
    found: list[Call | Once] = []
    for index, path in enumerate(paths):
        block = model
        for part in path.split("."):  # (getattr: the renamed list's own indexing asks for the access, not yet made)
            block = getattr(block, part)
        found.append(Call(index, block, seen.get(path, 0)))
        seen[path] = seen.get(path, 0) + 1
    return found


def mount(model) -> Applications | None:
    """Where `model`'s family runs its blocks several times per forward, or keeps them in parallel lists:
    `model.layers` as their applications, or as the gathered blocks (returned); else None, and nothing changes."""
    family = model.family
    declared = getattr(family, "applications", None)  # a method of the families that run blocks repeatedly
    paths = None if declared is None else declared(model.config)
    gathered = gathered_blocks(model._module, family)
    if paths is not None:
        found = calls(model, tuple(paths))
    elif gathered is not None:  # an envoy of each; its modules' envoys are the model's own (nnsight aliases them)
        found = [
            Once(index, GatheredEnvoy(block, path=f"{model.path}.layers.{index}", interleaver=model.interleaver))
            for index, block in enumerate(gathered)
        ]
    else:
        return None
    roles = {
        **dict.fromkeys(("self_attn", family.attention), AttentionEnvoy),
        **dict.fromkeys(("mlp", family.mlp), MLPEnvoy),
    }
    applications = Applications(model, found, roles)
    object.__setattr__(model, "layers", applications)
    return applications
