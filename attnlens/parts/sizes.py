"""Where an attention module's sizes are read: attribute paths on the module, tried in order, as data.

Each size is a tuple of entries; the first that gives a value wins. An entry is an attribute path on the attention
module (dotted: `"config.num_attention_heads"`, `"self.attention_head_size"`), a number, or a function of the module
and the sizes read so far (`lambda module, found: found["num_heads"] // module.num_key_value_groups`). A path that is
missing or holds None, and a function that raises AttributeError, fall through to the next entry. Sizes are read in the
order of the fields, so an entry may use the ones above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import reduce
from typing import Any, Union

from ..geometry import HeadGeometry

Entry = Union[str, float, Callable[[Any, dict], Any], "FamilyMethod"]


@dataclass(frozen=True)
class FamilyMethod:
    """An entry read by a method of the family, `family.<name>(module)`: attnlens 0.1's spelling of sizes (one method
    per size), which `Family` still folds into its `sizes`."""

    name: str


def same_as(size: str) -> Callable[[Any, dict], Any]:
    """An entry that repeats a size read above (`same_as("num_heads")` for one key/value head per query head)."""
    return lambda module, found: found[size]


@dataclass(frozen=True)
class Sizes:
    num_heads: tuple[Entry, ...] = ("config.num_attention_heads",)  #: query heads
    num_kv_heads: tuple[Entry, ...] = ("config.num_key_value_heads", same_as("num_heads"))  #: before repetition
    head_dim: tuple[Entry, ...] = ("head_dim",)  #: one head's values and outputs
    qk_head_dim: tuple[Entry, ...] = (same_as("head_dim"),)  #: one head's queries and keys
    scale: tuple[Entry, ...] = ("scaling",)  #: the factor the scores are multiplied by

    def read(self, module: Any, family: Any = None) -> dict[str, Any]:
        """Every size of the attention `module`, by name (`family` answers `FamilyMethod` entries)."""
        found: dict[str, Any] = {}
        for size in fields(self):
            entries = getattr(self, size.name)
            for entry in entries if isinstance(entries, tuple) else (entries,):
                value = (
                    getattr(family, entry.name)(module)
                    if isinstance(entry, FamilyMethod)
                    else _value(entry, module, found)
                )
                if value is not None:
                    found[size.name] = value
                    break
            else:
                raise AttributeError(f"{type(module).__name__} has none of {entries!r} for its {size.name}")
        return found

    def geometry(self, module: Any, family: Any = None) -> HeadGeometry:
        """The heads of the attention `module` (transformers'), read as the entries say. A family whose heads carry
        more (Doge's dynamic mask) or whose attention is several modules (LongCat-Flash's pair) states a subclass."""
        return HeadGeometry(**self.read(module, family))


def _value(entry: Entry, module: Any, found: dict) -> Any:
    if isinstance(entry, str):
        try:
            return reduce(getattr, entry.split("."), module)
        except AttributeError:
            return None
    if callable(entry):
        try:
            return entry(module, found)
        except AttributeError:
            return None
    return entry


def kv_heads_from_groups(module: Any, found: dict) -> Any:
    """Key/value heads as the query heads over the module's `num_key_value_groups` (sizes that differ per layer)."""
    return found["num_heads"] // module.num_key_value_groups
