"""What vLLM's worker keeps for attnlens: a request's keys and values as its attention kernel received them.

vLLM's own KV cache holds every earlier key too, but paged and in a backend-specific layout; a copy in the kernel's
own layout, `[tokens, heads * dim]`, is simple and the same on every backend. It lives as long as the request.
"""

from __future__ import annotations

import torch


class History:
    """One request's kept keys and values: per layer, rows in the kernel's layout `[tokens, heads * dim]`.

    Buffers double when full, so keeping a decode step's row costs a copy of that row, not of the whole context.
    """

    def __init__(self) -> None:
        self.layers: dict[int, list[torch.Tensor]] = {}
        self.filled: dict[int, int] = {}

    def keep(self, layer: int, position: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        end = position + keys.shape[0]
        kept = self.layers.get(layer)
        if kept is None or kept[0].shape[0] < end:
            capacity = max(end, 2 * (kept[0].shape[0] if kept else 0), 16)
            grown = [x.new_empty((capacity, x.shape[1])) for x in (keys, values)]
            if kept is not None:
                for new, old in zip(grown, kept):
                    new[:position] = old[:position]
            self.layers[layer] = kept = grown
        kept[0][position:end] = keys
        kept[1][position:end] = values
        self.filled[layer] = end

    def before(self, layer: int, position: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of the tokens before `position` (None before any was kept)."""
        if position == 0:
            return None
        if self.filled.get(layer, 0) < position:
            raise RuntimeError(
                f"attnlens kept {self.filled.get(layer, 0)} of the {position} earlier tokens' keys at layer {layer}: "
                f"the kernel never received the others (prefix caching serves them from vLLM's cache without a "
                f"forward); leave enable_prefix_caching off, as nnsight does by default"
            )
        kept = self.layers[layer]
        return kept[0][:position], kept[1][:position]

    def upto(self, layer: int, end: int, which: int) -> torch.Tensor:
        """Keys (0) or values (1) of the tokens before `end`, this step's included."""
        return self.layers[layer][which][:end]

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for kept in self.layers.values() for x in kept)

    def free(self) -> None:
        self.layers.clear()
        self.filled.clear()
