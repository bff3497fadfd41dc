"""Reading forwards' source through nnsight: the operations nnsight names inside a function, with their lines. The
one module that does it, for the load-time check of a family's anchors (`Anchored.verify`), the inferred common
layout (`attnlens.inferred`) and the survey."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ..errors import LocationDrift
from ..locations import INTERFACE_CALL, Location, Operation
from ..values import BY_NAME


def transformers_defines(module: str, name: str, attribute: str) -> bool:
    """Whether the installed transformers' class `name` (in `transformers.models.<module>`) defines `attribute`: how a
    family tells a release that runs its own attention arithmetic from one that calls the shared interface."""
    import importlib

    return hasattr(getattr(importlib.import_module(f"transformers.models.{module}"), name), attribute)


def compiled(function: Callable):
    """The innermost function (decorators peeled) and nnsight's compiled source of it."""
    from nnsight.intervention.source import compiled as compile_source
    from nnsight.intervention.source import decorator_chain

    innermost, _ = decorator_chain(function)
    return innermost, compile_source(innermost)


def operation_lines(function: Callable) -> dict[str, str]:
    """The operations nnsight names inside `function` (decorators peeled), each with its source line."""
    _, code = compiled(function)
    lines = code.source.split("\n")
    return {name: lines[code.lines[name] - 1].strip() for name in code.names}


class Anchored:
    """Mixin of `Family`: every recorded operation checked against the installed transformers when a model loads."""

    def drilled_functions(self, attention_module: torch.nn.Module) -> dict[str, Callable]:
        """The functions the attention forward's calls run under eager, by call name, for load-time checks."""
        module = sys.modules[type(attention_module).__module__]
        return {INTERFACE_CALL: module.eager_attention_forward}

    def verify(self, model, layer: int, layer_module, attention_module) -> None:
        """Check every recorded operation of `layer` against the installed transformers; raise `LocationDrift` if one
        moved."""
        from transformers import __version__

        scopes = {"attention": attention_module}
        for name, location in self.locations_for(model.config, layer).items():
            while hasattr(location, "source") and isinstance(location.source, Location):
                location = location.source
            if not isinstance(location, Operation):
                continue
            scope = BY_NAME[name].scope if name in BY_NAME else "attention"
            if scope == "mlp":  # read on the MLP's envoy, so relative to the MLP module
                scopes.setdefault("mlp", layer_module.get_submodule(self.mlp))
            if scope == "cross_attention":  # read on the cross-attention's envoy
                scopes.setdefault(scope, layer_module.get_submodule(self.cross_attention))
            host = scopes.get(scope, layer_module)
            for part in filter(None, location.module.split(".")):
                host = getattr(host, part)
            function = type(host).forward
            where = f"{type(host).__name__}.forward"
            for depth, op_name in enumerate(location.path):
                lines = operation_lines(function)
                if op_name not in lines or (
                    location.anchor and depth == len(location.path) - 1 and location.anchor not in lines[op_name]
                ):
                    stem = op_name.rsplit("_", 1)[0]
                    similar = {n: line for n, line in lines.items() if n.rsplit("_", 1)[0] == stem}
                    found = "; ".join(f"{n}: `{line}`" for n, line in similar.items()) or "no operation of that name"
                    expected = f"operation {op_name!r}" + (
                        f" on a line containing {location.anchor!r}" if location.anchor else ""
                    )
                    code = sys.modules.get(getattr(function, "__module__", ""), None)
                    origin = getattr(code, "__name__", "")
                    moved = (
                        f"(transformers {__version__}), found {found}. The installed transformers moved this value"
                        if origin.startswith("transformers.")
                        else f"(the model's own code, {origin or 'not in transformers'}), found {found}. The model's "
                        f"code differs from what the family states"
                    )
                    raise LocationDrift(
                        f"family {self.name}, value {name}: expected {expected} in {where} {moved}; update the "
                        f"family's location (see docs/extending.md)."
                    )
                if depth < len(location.path) - 1:
                    drilled = self.drilled_functions(attention_module)
                    if op_name not in drilled:
                        break  # resolved only at run time; the identities in the test suite check it
                    function = drilled[op_name]
                    where = f"{getattr(function, '__qualname__', function)}"
