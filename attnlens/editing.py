"""Editing scores without lifting the mask.

Masked entries of `attention_scores` hold the dtype's minimum (added by the mask), so overwriting or multiplying the
scores turns them into real scores and every query then sees the tokens after it. `keep_masked` writes new scores
only where the mask let a score through.
"""

from __future__ import annotations

import torch


def masked(scores: torch.Tensor) -> torch.Tensor:
    """True where `scores` are masked: at or below half the dtype's minimum (a score plus the minimum stays there)."""
    return scores <= torch.finfo(scores.dtype).min / 2


def keep_masked(scores: torch.Tensor, new: torch.Tensor | float) -> torch.Tensor:
    """`new` where the mask let a score through, the original masked entry elsewhere.

    attn.attention_scores = attnlens.keep_masked(attn.attention_scores, 0.0)   # uniform over visible keys
    """
    new = torch.as_tensor(new, dtype=scores.dtype, device=scores.device)
    return torch.where(masked(scores), scores, new)
