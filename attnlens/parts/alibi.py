"""ALiBi (Bloom, Falcon, MPT): a per-head linear bias on the scores by key position."""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """Bloom's (and Falcon's) per-head ALiBi slopes, float32: a geometric series from the nearest lower power of two,
    then every other slope of the next power of two for the remaining heads."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32, device=device)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32, device=device))
    if closest != num_heads:
        extra_base = torch.full((), 2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32, device=device)
        remaining = min(closest, num_heads - closest)
        extra = torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32, device=device))
        slopes = torch.cat([slopes, extra])
    return slopes


def key_positions(num_keys: int, key_mask: torch.Tensor | None, device=None) -> torch.Tensor:
    """The position ALiBi gives each key, [batch or 1, key]: padding is skipped, padded keys get 0."""
    if key_mask is None:
        return torch.arange(num_keys, device=device)[None]
    key_mask = key_mask.long()
    return (key_mask.cumsum(dim=-1) - 1) * key_mask
