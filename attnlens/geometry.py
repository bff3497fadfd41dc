"""The sizes of one layer's attention heads, computed once: from the module on eager, from the kernel on vLLM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadGeometry:
    num_heads: int  #: query heads
    num_kv_heads: int  #: key/value heads, before grouped heads are repeated
    head_dim: int  #: one head's values and outputs
    qk_head_dim: int  #: one head's queries and keys (differs from head_dim under latent attention)
    scale: float  #: the factor the scores are multiplied by

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def sizes(self) -> dict[str, int]:
        """The catalogue's head axes, by name (`values.Value.axes`)."""
        return {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "qk_head_dim": self.qk_head_dim,
        }
