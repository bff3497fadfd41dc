"""Which family serves a model type: the built-in family modules, found by file, and the families users register.

Each module in `attnlens/families/` is the registry entry of the families it defines: every `Family` subclass there
that names its own `model_types` serves them. A family defined elsewhere is added with `@attnlens.register`, and a
registered family wins over a built-in one for the same model type.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from .errors import UnknownFamily
from .family import Family

_BUILT_IN: dict[str, type[Family]] = {}
_REGISTERED: dict[str, type[Family]] = {}


def register(family: type[Family]) -> type[Family]:
    """Register a family for each of its `model_types` (usable as a class decorator). Later registrations win."""
    if not family.model_types:
        raise ValueError(f"{family.__name__} names no model_types; set model_types = ('your_model_type',)")
    for model_type in family.model_types:
        _REGISTERED[model_type] = family
    return family


def _built_in() -> dict[str, type[Family]]:
    if not _BUILT_IN:
        from . import families

        for info in pkgutil.iter_modules(families.__path__):
            module = importlib.import_module(f"{families.__name__}.{info.name}")
            for _, found in inspect.getmembers(module, inspect.isclass):
                if issubclass(found, Family) and found.__module__ == module.__name__ and "model_types" in vars(found):
                    _BUILT_IN.update(dict.fromkeys(found.model_types, found))
    return _BUILT_IN


def registered() -> dict[str, type[Family]]:
    """Every model type attnlens has a family for, and that family."""
    return {**_built_in(), **_REGISTERED}


def family_for(model_type: str) -> Family:
    """A new instance of the family that serves `model_type`."""
    families = registered()
    if model_type not in families:
        raise UnknownFamily(
            f"attnlens has no family registered for model type {model_type!r}; registered: "
            f"{', '.join(sorted(families))} (docs/extending.md adds one)"
        )
    return families[model_type]()


def resolve_family(family: Family | type[Family] | str) -> Family:
    """A family given as a registered model type's name, a `Family` subclass or an instance."""
    if isinstance(family, str):
        return family_for(family)
    if isinstance(family, type) and issubclass(family, Family):
        return family()
    if isinstance(family, Family):
        return family
    raise TypeError(
        f"family= takes a registered model type's name (e.g. 'llama'), an attnlens.Family subclass or "
        f"an instance; got {family!r}"
    )
