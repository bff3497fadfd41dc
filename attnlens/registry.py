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
from .family import EncoderDecoder, Family, RefusedEncoder

_BUILT_IN: dict[str, type[Family]] = {}
_REGISTERED: dict[str, type[Family]] = {}
#: The encoder-decoders (`attnlens.stacks.EncoderDecoder`: a family per stack), by model type.
_ENCODER_DECODERS: dict[str, type[EncoderDecoder]] = {}
#: The encoder-decoders attnlens knows and does not serve (an `EncoderDecoder` with `refused`), and why.
_REFUSED_ENCODER_DECODERS: dict[str, str] = {}
#: The encoders attnlens knows and does not serve (a `RefusedEncoder`), and why.
_REFUSED_ENCODERS: dict[str, str] = {}


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
                if found.__module__ != module.__name__ or "model_types" not in vars(found):
                    continue
                if issubclass(found, Family):
                    _BUILT_IN.update(dict.fromkeys(found.model_types, found))
                elif issubclass(found, EncoderDecoder) and found.refused:
                    _REFUSED_ENCODER_DECODERS.update(dict.fromkeys(found.model_types, found.refused))
                elif issubclass(found, EncoderDecoder):
                    _ENCODER_DECODERS.update(dict.fromkeys(found.model_types, found))
                elif issubclass(found, RefusedEncoder):
                    _REFUSED_ENCODERS.update(dict.fromkeys(found.model_types, found.refused))
    return _BUILT_IN


def encoder_decoders() -> dict[str, type[EncoderDecoder]]:
    """Every encoder-decoder model type attnlens serves (`StandardizedSeq2Seq`), and its family."""
    _built_in()
    return dict(_ENCODER_DECODERS)


def refused_encoder_decoders() -> dict[str, str]:
    """Every encoder-decoder model type attnlens knows and does not serve, and why."""
    _built_in()
    return dict(_REFUSED_ENCODER_DECODERS)


def refused_encoders() -> dict[str, str]:
    """Every encoder model type attnlens knows and does not serve (`RefusedEncoder`), and why."""
    _built_in()
    return dict(_REFUSED_ENCODERS)


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


def encoder_decoder_for(model_type: str) -> EncoderDecoder:
    found = encoder_decoders().get(model_type)
    if model_type in _REFUSED_ENCODER_DECODERS:
        raise UnknownFamily(
            f"attnlens has no encoder-decoder family for model type {model_type!r}: "
            f"{_REFUSED_ENCODER_DECODERS[model_type]}"
        )
    if found is None:
        raise UnknownFamily(
            f"attnlens has no encoder-decoder family for model type {model_type!r}; it serves "
            f"{', '.join(sorted(encoder_decoders()))} (docs/encoders.md)"
        )
    return found()
