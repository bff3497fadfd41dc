"""Notes and reasons as data (`Family.kind_notes`, `Family.kind_reasons`): selector -> {value name: note}, applied on
top of what a family's `notes()` / `unavailable()` say, by the layer's kind.

A selector is "*" (every layer) or words that must all hold: a tag of the layer (its `layer_kind`, its
`config.layer_types` entry, the engine) or "!tag" for one it lacks. A note is a template formatted with `config`,
`family` and `layer` (`"{config.logit_scale:g}"`), a function (family, config, layer) -> str or None (None: nothing
said), `Joined(note)` (added to what is said so far), or None (drops a note a base class gave).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class Joined(NamedTuple):
    """A note (a template or a function, as in `Family.kind_notes`) joined to what is said of the value so far instead
    of replacing it: after it, or `before` it, with `sep` between."""

    note: object
    sep: str = "; "
    before: bool = False


#: A note or reason in a table.
Note = str | Callable[[Any, object, int], str | None] | Joined | None


def selects(selector: str, tags: frozenset[str]) -> bool:
    """Whether a selector holds for a layer with `tags`: "*" always; otherwise every word, a tag the layer has, or
    "!tag" one it lacks."""
    return selector == "*" or all(
        (word[1:] not in tags) if word.startswith("!") else (word in tags) for word in selector.split()
    )


def tags(family: Any, config: Any, layer: int, engine: str) -> frozenset[str]:
    """What selectors test on `layer`: its `layer_kind` tags, its `config.layer_types` entry (a window's
    "sliding_attention"), the engine."""
    layer_types = getattr(config, "layer_types", None) or ()
    own = {layer_types[layer]} if layer < len(layer_types) and isinstance(layer_types[layer], str) else set()
    return family.layer_kind(config, layer) | own | {engine}


def formatted(family: Any, note: Any, config: Any, layer: int) -> str | None:
    """A note's text on `layer` of a model of `config`."""
    if callable(note):
        return note(family, config, layer)
    return note.format(config=config, family=family, layer=layer)


def apply(family: Any, table: dict, said: dict[str, str], config: Any, layer: int, engine: str) -> dict[str, str]:
    """`said` with the entries of `table` that select `layer`, formatted."""
    held = tags(family, config, layer, engine)
    for selector, entries in table.items():
        if not selects(selector, held):
            continue
        for name, note in entries.items():
            if note is None:  # the layer has no note on the value: drop one a base class gave
                said.pop(name, None)
                continue
            joined = isinstance(note, Joined)
            text = formatted(family, note.note if joined else note, config, layer)
            if text is not None and joined:
                parts = (text, said.get(name)) if note.before else (said.get(name), text)
                text = note.sep.join(filter(None, parts))
            if text is not None:
                said[name] = text
    return said


def tabled(cls: type, method: str, table: str) -> Callable:
    """`cls.<method>` ("notes", "unavailable") with `cls.<table>` applied on top: the class's own override if it has
    one, else its bases'."""
    own = vars(cls).get(method)

    def with_table(self, config, layer, engine="transformers"):
        said = own(self, config, layer, engine) if own else getattr(super(cls, self), method)(config, layer, engine)
        return apply(self, vars(cls)[table], said, config, layer, engine)

    base = next((vars(k)[method] for k in cls.__mro__[1:] if method in vars(k)), None)
    with_table.__doc__ = (own or base).__doc__ if (own or base) else None
    with_table.__qualname__ = f"{cls.__qualname__}.{method}"
    with_table.tabled = True  # type: ignore[attr-defined]
    return with_table
