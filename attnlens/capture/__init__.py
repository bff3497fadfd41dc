"""Capturing values without writing a trace: `capture_attention`, `run_with_cache` and their helpers.

Both take one prompt or many (a list of any length, batched with left padding; results come back unpadded, one per
prompt), check every request against `support()` before the model runs, and can write results to disk as
safetensors instead of holding them. On a model loaded with `rebuild_patterns=True` the patterns are rebuilt from the
queries and keys, and `capture_attention` computes only the requested rows and heads, in chunks of rows.

- `names.py`: cache names and `Cache`;
- `plan.py`: what to read, checked before the model runs;
- `runs.py`: prompts, batches, progress and disk;
- `api.py`: `run_with_cache` and `capture_attention`;
- `helpers.py`: `per_head_value`, `attn_out_gate`, `split_fused_qkv`.
"""

from ..names import CACHE_NAMES, FUSED, Cache, cache_key
from .api import KINDS, capture_attention, run_with_cache
from .helpers import attn_out_gate, per_head_value, split_fused_qkv
from .runs import Stored, prompts_of

__all__ = [
    "CACHE_NAMES",
    "FUSED",
    "KINDS",
    "Cache",
    "Stored",
    "attn_out_gate",
    "cache_key",
    "capture_attention",
    "per_head_value",
    "prompts_of",
    "run_with_cache",
    "split_fused_qkv",
]
