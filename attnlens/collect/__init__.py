"""Attention statistics over a whole corpus: `collect(model, corpus, features=..., out=DIR)`.

- `corpus.py`: streaming readers (JSONL, text, Parquet, `datasets.Dataset`);
- `features.py`: the open registry of per-head features, computed inside the trace (in vLLM's worker on vLLM);
- `store.py`: sharded Parquet, the commit protocol that makes a restart exactly-once, `read_table`;
- `collector.py`: a window of prompts computed on one model; `inworker.py`: on vLLM, features reduced at the
  attention op from static taps, without a trace; `attribution.py`: the `head_attribution` feature; `run.py`: the
  loop (`collect`) and the run's result; `ray_pool.py`: windows computed on Ray, one engine per worker.

See docs/corpus.md.
"""

from . import attribution  # noqa: F401  registers head_attribution
from .corpus import Corpus, Record
from .features import FEATURES, Context, Feature, register
from .inworker import points_for
from .run import DEFAULT_FEATURES, CollectResult, collect
from .store import CollectMismatch, read_table

__all__ = [
    "DEFAULT_FEATURES",
    "FEATURES",
    "CollectMismatch",
    "CollectResult",
    "Context",
    "Corpus",
    "Feature",
    "Record",
    "collect",
    "points_for",
    "read_table",
    "register",
]
