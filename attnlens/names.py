"""Cache names: each standardized value's short name from the catalogue (`"attn_probs.10"`, `"value.10"`,
`"logits"`), and `Cache`, the captured values by those names."""

from __future__ import annotations

import torch

from .values import ALL_VALUES, BY_NAME, BY_SHORT, closest

#: Standardized value name -> cache name, for every value of the catalogue.
CACHE_NAMES = {value.name: value.short for value in ALL_VALUES}
#: Not a standardized value: the output of a fused query/key/value projection (`Family.fused_qkv`), for
#: `split_fused_qkv`. Read at the projection, so it comes before the queries.
FUSED = "qkv"


def value_of(short: str) -> str:
    """The standardized value a cache name (or a standardized name) stands for."""
    return (BY_SHORT.get(short) or BY_NAME[short]).name


def split_name(name: str, layer: int | None) -> tuple[str, int | None]:
    """("attn_probs.10", None) or ("attn_probs", 10) -> ("attn_probs", 10); also accepts standardized names."""
    if layer is None and "." in name:
        head, _, tail = name.rpartition(".")
        if tail.lstrip("-").isdigit():
            name, layer = head, int(tail)
    if name != FUSED and name not in BY_SHORT and name not in BY_NAME:
        known = ", ".join([*CACHE_NAMES.values(), FUSED])
        raise KeyError(
            f"{name!r} is not a cache name.{closest(name)} Known: {known} (or a standardized value "
            f"name), followed by '.<layer>' for block values"
        )
    short = FUSED if name == FUSED else CACHE_NAMES[value_of(name)]
    model_scope = name != FUSED and BY_SHORT[short].scope == "model"
    if model_scope and layer is not None:
        raise KeyError(f"{short!r} is a model value: name it without a layer")
    if not model_scope and layer is None:
        raise KeyError(f"{short!r} is read per block: name a layer, e.g. '{short}.0'")
    return short, layer


def cache_key(name: str, layer: int | None = None) -> str:
    short, layer = split_name(name, layer)
    return short if layer is None else f"{short}.{layer}"


class Cache:
    """Captured values by cache name: `cache.get("attn_probs", 10)` or `cache["attn_probs.10"]`, batch axis first."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = dict(tensors)

    def get(self, name: str, layer: int | None = None) -> torch.Tensor:
        key = cache_key(name, layer)
        if key not in self._tensors:
            raise KeyError(
                f"{key!r} was not captured; this cache holds {', '.join(self._tensors) or 'nothing'}: add "
                f"it to run_with_cache's names"
            )
        return self._tensors[key]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.get(key)

    def __contains__(self, key: str) -> bool:
        return cache_key(key) in self._tensors

    def keys(self):
        return self._tensors.keys()

    def items(self):
        return self._tensors.items()

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{key}: {list(t.shape)}" for key, t in self._tensors.items())
        return f"Cache({shapes})"
