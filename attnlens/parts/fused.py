"""How a fused query/key/value projection lays out its output, and the split that follows that layout.

A family with one projection for queries, keys and values sets `Family.fused_qkv = FusedQKV(module, layout)`.
Two layouts cover the transformers families:

- `"blocks"`: all queries, then all keys, then all values along the last axis, `[q (heads) | k (kv heads) | v]`
  (GPT-2, MPT, Phi-3, GPT-BigCode with multi-query);
- `"groups"`: one group per key/value head, each holding its query heads, then its key, then its value,
  `[kv heads, heads / kv heads + 2, head_dim]` (Falcon in all three of its layouts; with as many key/value heads as
  query heads it is per head `[q|k|v]`: GPT-NeoX, BLOOM, GPT-BigCode without multi-query).

Query head `h` belongs to group `h // (heads / kv heads)`, the grouping attention repeats keys and values by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LAYOUTS = {
    "blocks": "[queries | keys | values] along the last axis",
    "groups": "per key/value head: its query heads, then its key, then its value",
}


@dataclass(frozen=True)
class FusedQKV:
    module: str  #: the projection, from the attention module (`"c_attn"`, `"query_key_value"`)
    layout: Literal["blocks", "groups"]

    def width(self, heads: int, kv_heads: int, head_dim: int) -> int:
        return (heads + 2 * kv_heads) * head_dim  # the same in both layouts

    def split(
        self, fused: torch.Tensor, heads: int, kv_heads: int, head_dim: int, where: str = ""
    ) -> dict[str, torch.Tensor]:
        """{"q": [..., heads, head_dim], "k": [..., kv_heads, head_dim], "v": [..., kv_heads, head_dim]}.

        Raises ValueError on a tensor whose last axis is not this projection's width: a wrong split would look like
        a plausible tensor."""
        if heads % kv_heads:
            raise ValueError(f"{where}: {heads} query heads do not group over {kv_heads} key/value heads")
        width = self.width(heads, kv_heads, head_dim)
        if not isinstance(fused, torch.Tensor) or fused.dim() < 1 or fused.shape[-1] != width:
            got = tuple(fused.shape) if isinstance(fused, torch.Tensor) else type(fused).__name__
            raise ValueError(
                f"{where} fuses queries, keys and values in `{self.module}`, laid out {LAYOUTS[self.layout]}: its "
                f"output's last axis is {width} wide ({heads} query heads + 2 x {kv_heads} key/value heads, of "
                f"{head_dim}); got {got}. Pass that projection's output (cache name 'qkv.<layer>'), not a value "
                f"already split per head"
            )
        if self.layout == "blocks":
            q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
            return {
                "q": q.unflatten(-1, (heads, head_dim)),
                "k": k.unflatten(-1, (kv_heads, head_dim)),
                "v": v.unflatten(-1, (kv_heads, head_dim)),
            }
        groups = heads // kv_heads
        grouped = fused.unflatten(-1, (kv_heads, groups + 2, head_dim))
        return {
            "q": grouped[..., :groups, :].flatten(-3, -2),
            "k": grouped[..., groups, :],
            "v": grouped[..., groups + 1, :],
        }
