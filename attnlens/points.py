"""What a capture reads, checked before the model runs, and how each point is read inside a trace.

Only the surface both model classes share is used: `model.access` (support, order, layers), `model.family` and the
envoys, so the same plan runs on either engine.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .errors import Unavailable
from .names import FUSED, split_name, value_of
from .values import BY_NAME

#: Axes that run over positions: unpadding slices them.
POSITION_AXES = ("seq", "query", "key")


def reason(model, short: str, layer: int | None) -> str | None:
    """Why the point cannot be read on `model` (None: it can)."""
    if short == FUSED:
        if model.family.fused_qkv is None:
            return (
                f"the {model.family.name} family has separate query, key and value projections; read "
                f"'query', 'key' and 'value' instead"
            )
        return None
    return model.access.reasons(layer).get(value_of(short))


def points(model, names: Iterable[str]) -> list[tuple[str, int | None]]:
    """(cache name, layer) of each name, in forward order; unknown or unavailable names raise here."""
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError("no names given: name at least one value to capture, e.g. 'attn_probs.0'")
    found = []
    for name in names:
        short, layer = split_name(name, None)
        if layer is not None:
            layer = model.access.check_layer(layer)
        why = reason(model, short, layer)
        if why is not None:
            where = short if layer is None else f"{short}.{layer}"
            raise Unavailable(f"{where} on {model.family.name}: {why}")
        found.append((short, layer))
    return sorted(dict.fromkeys(found), key=lambda point: position(model, *point))


def position(model, short: str, layer: int | None) -> tuple:
    if short == FUSED:  # the projection runs before the attention function receives its split
        block, rank = model.access.position("attention_queries", layer)
        return block, rank - 0.5
    return model.access.position(value_of(short), layer)


def read(model, short: str, layer: int | None):
    """Read one point inside a trace."""
    if short == FUSED:
        attn = model.layers[layer].self_attn
        attn.source  # noqa: B018  instrument the attention forward now: values read through it come after
        return getattr(attn, model.family.fused_qkv.module).output
    value = BY_NAME[value_of(short)]
    host = {
        "model": lambda: model,
        "layer": lambda: model.layers[layer],
        "attention": lambda: model.layers[layer].self_attn,
        "mlp": lambda: model.layers[layer].mlp,
    }[value.scope]()
    return getattr(host, value.name)


def unpad(tensor: torch.Tensor, short: str, row: int, span: slice) -> torch.Tensor:
    """Row `row` of a batched value (batch axis kept), its positions those of `span` (where the prompt lies in the
    padded batch: `capture.runs.spans`); a copy."""
    layout = ("batch", "seq", "fused") if short == FUSED else BY_NAME[value_of(short)].axes
    index = [slice(row, row + 1)] + [span if axis in POSITION_AXES else slice(None) for axis in layout[1:]]
    return tensor[tuple(index)].clone()
