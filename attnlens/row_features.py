"""What a served request may ask of each row of attention: per layer, head and query row, a few numbers.

Each feature reduces rows of a pattern, `probabilities` `[heads, rows, keys]` (float32; each row's masked keys exactly
zero, as the rebuilt pattern has them), given the rows' positions and the request (`Rows`), to named arrays whose
first two axes are heads and rows. vLLM's worker runs them on the rows it rebuilds at each step (attnlens/vllm/
serving.py, for `attnlens serve`), and `of_pattern` runs them on a whole pattern (the eager engine's, say), so the
served numbers and the ones computed by hand on `StandardizedTransformer` are the same code. Clients name features
from this registry only: nothing a client sends is executed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rows:
    """The rows one step reduces, and what the request asked: `positions` `[rows]` (each row's position in the
    sequence: prompt then generated tokens), the prompt's length (one, or per row), the spans of `span_mass` (token
    ranges, end exclusive) and `top_k`. `offsets` `[rows]`: where each row's key 0 sits on the key axis, in a batch of
    rows of different requests left-padded to one length (None: at 0)."""

    positions: torch.Tensor
    prompt_tokens: int | torch.Tensor
    spans: tuple[tuple[int, int], ...] = ()
    top_k: int = 5
    offsets: torch.Tensor | None = None

    def keys(self, width: int) -> torch.Tensor:
        """`[rows, width]`: the position of each key column for each row (negative on a row's padding)."""
        columns = torch.arange(width)
        return columns.expand(len(self.positions), -1) if self.offsets is None else columns - self.offsets[:, None]

    def at(self, p: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`[heads, rows]`: each row's weight on the key at `positions` `[rows]`."""
        columns = positions if self.offsets is None else positions + self.offsets
        return p.gather(-1, columns.clamp(min=0).expand(p.shape[0], -1)[..., None])[..., 0]


@dataclass(frozen=True)
class RowFeature:
    """One feature: `arrays` (name -> dtype and what each row holds past the heads and rows axes), `compute`."""

    name: str
    description: str
    arrays: dict[str, tuple[str, str]]
    compute: Callable[[torch.Tensor, Rows], dict[str, torch.Tensor]]
    #: values per row and head, given the request and the widest row (`keys`): for the output budget
    width: Callable[[Rows, int], int] = lambda rows, keys: 1


def _entropy(p: torch.Tensor, rows: Rows) -> dict:
    return {"entropy": torch.special.entr(p).sum(-1)}


def _sink(p: torch.Tensor, rows: Rows) -> dict:
    return {"sink": rows.at(p, torch.zeros_like(rows.positions))}


def _previous(p: torch.Tensor, rows: Rows) -> dict:
    found = rows.at(p, rows.positions - 1)
    return {"previous": torch.where(rows.positions >= 1, found, torch.nan)}


def _top_keys(p: torch.Tensor, rows: Rows) -> dict:
    k = min(rows.top_k, p.shape[-1])
    weights, columns = p.topk(k, dim=-1)
    keys = columns if rows.offsets is None else columns - rows.offsets[:, None]
    # a row's masked keys and padding (weight 0) are not among its top keys
    seen = (keys >= 0) & (keys <= rows.positions[:, None])
    weights, keys = weights.where(seen, 0.0), keys.where(seen, -1)
    if k < rows.top_k:  # fewer keys than asked: padded as past the keys a row sees
        pad = rows.top_k - k
        weights = torch.nn.functional.pad(weights, (0, pad))
        keys = torch.nn.functional.pad(keys, (0, pad), value=-1)
    return {"top_keys": keys.int(), "top_weights": weights}


def _pattern(p: torch.Tensor, rows: Rows) -> dict:
    if rows.offsets is None:
        return {"pattern": p}
    width = int(rows.positions.max()) + 1  # each row's keys from its key 0, zero past its own position
    columns = rows.offsets[:, None] + torch.arange(width)
    found = p.gather(-1, columns.clamp(max=p.shape[-1] - 1).expand(p.shape[0], -1, -1))
    return {"pattern": found.where(torch.arange(width) <= rows.positions[:, None], 0.0)}


def _span_mass(p: torch.Tensor, rows: Rows) -> dict:
    if not rows.spans:
        return {"span_mass": p.new_zeros(*p.shape[:2], 0)}
    keys = rows.keys(p.shape[-1])  # [rows, keys]
    inside = torch.stack([(keys >= start) & (keys < end) for start, end in rows.spans], 1)  # [rows, spans, keys]
    return {"span_mass": torch.einsum("hrk,rsk->hrs", p, inside.to(p.dtype))}


def _lookback(p: torch.Tensor, rows: Rows) -> dict:
    """Lookback Lens's ratio: the mean weight on a prompt token against the mean weight on a generated one, over the
    keys each row sees; nan where a row sees no generated token (the prompt's rows, and the first generated token's)."""
    prompt = torch.as_tensor(rows.prompt_tokens).expand(len(rows.positions))
    keys = rows.keys(p.shape[-1])
    on_prompt = (p * ((keys >= 0) & (keys < prompt[:, None]))).sum(-1) / prompt
    generated = (rows.positions + 1 - prompt).clamp(min=0)  # generated keys each row sees
    on_generated = (p * (keys >= prompt[:, None])).sum(-1) / generated.clamp(min=1)
    ratio = on_prompt / (on_prompt + on_generated)
    return {"lookback": torch.where(generated > 0, ratio, torch.nan)}


FEATURES: dict[str, RowFeature] = {
    feature.name: feature
    for feature in (
        RowFeature("entropy", "entropy of the row, in nats", {"entropy": ("float32", "")}, _entropy),
        RowFeature("sink", "weight on the first token", {"sink": ("float32", "")}, _sink),
        RowFeature(
            "previous",
            "weight on the token before the row's (nan at position 0)",
            {"previous": ("float32", "")},
            _previous,
        ),
        RowFeature(
            "top_keys",
            "the top_k keys of the row, heaviest first, and their weights (-1 and 0 past the keys the row sees)",
            {"top_keys": ("int32", "top_k"), "top_weights": ("float32", "top_k")},
            _top_keys,
            width=lambda rows, keys: 2 * rows.top_k,
        ),
        RowFeature(
            "pattern",
            "the whole row, over every key up to the widest row's (0 past the row's own position)",
            {"pattern": ("float32", "keys")},
            _pattern,
            width=lambda rows, keys: keys,
        ),
        RowFeature(
            "span_mass",
            "weight on each of the request's spans (token ranges, characters of the prompt, or chat messages)",
            {"span_mass": ("float32", "spans")},
            _span_mass,
            width=lambda rows, keys: len(rows.spans),
        ),
        RowFeature(
            "lookback",
            "Lookback Lens's ratio: mean weight on a prompt token / (that + mean weight on a generated token); nan "
            "where the row sees no generated token",
            {"lookback": ("float32", "")},
            _lookback,
        ),
    )
}


def compute(names: list[str], probabilities: torch.Tensor, rows: Rows) -> dict[str, torch.Tensor]:
    """The named features of these rows (`probabilities` `[heads, rows, keys]`, float32), each array on the CPU."""
    found = {}
    for name in names:
        found.update(FEATURES[name].compute(probabilities, rows))
    return {name: array.detach().cpu() for name, array in found.items()}


def of_pattern(
    names: list[str], pattern: torch.Tensor, positions: list[int], prompt_tokens: int, **request
) -> dict[str, torch.Tensor]:
    """The named features of the rows at `positions` of a whole pattern `[heads, queries, keys]` (one layer of
    `attention_probabilities` without its batch axis, say), keys cut at the widest row's: what a server returns for
    those rows, computed from a pattern read anywhere."""
    end = max(positions) + 1
    rows = Rows(torch.tensor(positions), prompt_tokens, **request)
    return compute(names, pattern[:, positions, :end].float(), rows)
