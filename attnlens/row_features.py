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
    sequence: prompt then generated tokens), the prompt's length, the spans of `span_mass` (token ranges, end
    exclusive), and `top_k`."""

    positions: torch.Tensor
    prompt_tokens: int
    spans: tuple[tuple[int, int], ...] = ()
    top_k: int = 5


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
    return {"sink": p[..., 0]}


def _previous(p: torch.Tensor, rows: Rows) -> dict:
    before = (rows.positions - 1).clamp(min=0)
    found = p.gather(-1, before.expand(p.shape[0], -1)[..., None])[..., 0]
    return {"previous": torch.where(rows.positions >= 1, found, torch.nan)}


def _top_keys(p: torch.Tensor, rows: Rows) -> dict:
    k = min(rows.top_k, p.shape[-1])
    weights, keys = p.topk(k, dim=-1)
    seen = keys <= rows.positions[:, None]  # a row's masked keys (weight 0) are not among its top keys
    weights, keys = weights.where(seen, 0.0), keys.where(seen, -1)
    if k < rows.top_k:  # fewer keys than asked: padded as past the keys a row sees
        pad = rows.top_k - k
        weights = torch.nn.functional.pad(weights, (0, pad))
        keys = torch.nn.functional.pad(keys, (0, pad), value=-1)
    return {"top_keys": keys.int(), "top_weights": weights}


def _pattern(p: torch.Tensor, rows: Rows) -> dict:
    return {"pattern": p}


def _span_mass(p: torch.Tensor, rows: Rows) -> dict:
    keys = p.shape[-1]
    found = [p[..., min(start, keys) : min(end, keys)].sum(-1) for start, end in rows.spans]
    return {"span_mass": torch.stack(found, -1) if found else p.new_zeros(*p.shape[:2], 0)}


def _lookback(p: torch.Tensor, rows: Rows) -> dict:
    """Lookback Lens's ratio: the mean weight on a prompt token against the mean weight on a generated one, over the
    keys each row sees; nan where a row sees no generated token (the prompt's rows, and the first generated token's)."""
    prompt = rows.prompt_tokens
    on_prompt = p[..., :prompt].sum(-1) / prompt
    generated = (rows.positions + 1 - prompt).clamp(min=0)  # generated keys each row sees
    on_generated = p[..., prompt:].sum(-1) / generated.clamp(min=1)
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
