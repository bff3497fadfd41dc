"""A served response's `attention` as tensors and a DataFrame (`attnlens serve`; docs/serve.md).

`numbers(response)` takes a response (a dict, the `openai` client's object, or the chunks of a stream) and gives, per
choice index, a `Numbers`: its layers, heads, row positions and each array as a tensor (`[layers, heads, rows, ...]`;
JSON's nulls as nan, base64 decoded). `frame(response)` lays the per-row numbers out long: one row per choice, layer,
head and position, a column per scalar feature. Needs torch only (pandas for `frame`); no vLLM.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Numbers:
    """One choice's numbers: `arrays[name]` is `[layers, heads, rows, ...]` on `layers` x `heads` x the rows at
    `positions` (prompt tokens first, then generated ones)."""

    index: int
    layers: list[int]
    heads: list[int]
    positions: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    spans: list[tuple[int, int]] = field(default_factory=list)
    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str | None = None

    def at(self, name: str, layer: int, head: int | None = None) -> torch.Tensor:
        """Array `name` on model layer `layer` (and head `head`): `[heads, rows, ...]` or `[rows, ...]`."""
        found = self.arrays[name][self.layers.index(layer)]
        return found if head is None else found[self.heads.index(head)]


def array(sent: dict) -> torch.Tensor:
    """One `AttentionArray` (shape, dtype, data) as a tensor."""
    dtype = getattr(torch, sent["dtype"])
    if isinstance(sent["data"], str):
        data = bytearray(base64.b64decode(sent["data"]))
        if not data:
            return torch.empty(sent["shape"], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(sent["shape"]).clone()
    found = torch.tensor(_none_to_nan(sent["data"]), dtype=dtype)
    return found.reshape(sent["shape"])


def _none_to_nan(value):
    if isinstance(value, list):
        return [_none_to_nan(v) for v in value]
    return float("nan") if value is None else value


def _as_dict(response: Any) -> dict:
    if isinstance(response, dict):
        return response
    if hasattr(response, "model_dump"):  # the openai client's objects keep unknown fields (`attention`) as extras
        return response.model_dump()
    raise TypeError(f"numbers() takes a response dict, an openai response or a stream's chunks; got {type(response)}")


def numbers(response: Any) -> dict[int, Numbers]:
    """Per choice index, its `Numbers`; a stream's chunks (any iterable of chunks) joined along the rows."""
    chunks = [response] if isinstance(response, dict) or hasattr(response, "model_dump") else list(response)
    found: dict[int, Numbers] = {}
    for chunk in chunks:
        for entry in _as_dict(chunk).get("attention") or []:
            index = entry.get("index", -1)
            arrays = {name: array(sent) for name, sent in (entry.get("arrays") or {}).items()}
            if index not in found:
                found[index] = Numbers(
                    index,
                    entry.get("layers", []),
                    entry.get("heads", []),
                    list(entry.get("positions", [])),
                    entry.get("prompt_tokens", 0),
                    [tuple(span) for span in entry.get("spans", [])],
                    arrays,
                    entry.get("error"),
                )
                continue
            held = found[index]
            held.positions += entry.get("positions", [])
            held.error = held.error or entry.get("error")
            for name, part in arrays.items():
                held.arrays[name] = _joined(held.arrays.get(name), part)
    return found


def _joined(before: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Rows of one array joined (axis 2); patterns padded with zeros to the wider keys."""
    if before is None:
        return part
    if part.dim() == 4 and before.shape[-1] != part.shape[-1]:
        width = max(before.shape[-1], part.shape[-1])
        before = torch.nn.functional.pad(before, (0, width - before.shape[-1]))
        part = torch.nn.functional.pad(part, (0, width - part.shape[-1]))
    return torch.cat([before, part], dim=2)


def frame(response: Any | Iterable):
    """One row per choice, layer, head and position, a column per scalar feature (entropy, sink, previous,
    lookback); `span_mass` as one column per span (`span_mass_0`, ...)."""
    import pandas as pd

    rows = []
    for index, found in sorted(numbers(response).items()):
        scalars = {name: a for name, a in found.arrays.items() if a.dim() == 3}
        spans = found.arrays.get("span_mass")
        for li, layer in enumerate(found.layers):
            for hi, head in enumerate(found.heads):
                for ri, position in enumerate(found.positions):
                    row = {"choice": index, "layer": layer, "head": head, "position": position}
                    row.update({name: float(a[li, hi, ri]) for name, a in scalars.items()})
                    if spans is not None:
                        row.update({f"span_mass_{s}": float(v) for s, v in enumerate(spans[li, hi, ri])})
                    rows.append(row)
    return pd.DataFrame(rows)
