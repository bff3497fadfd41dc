"""Compiled kernels for what PyTorch has no fused operation for: built from C with the machine's compiler on first use
(for this CPU: `-march=native`), cached, called through ctypes. They run on torch's own OpenMP threads: the library
links `libgomp.so.1`, which is the runtime torch already loaded (torch's wheels ship it under that name), so its
parallel loops take torch's thread count and, on vLLM's CPU worker, its threads bound to their cores.

`row_statistics`: per batch element and head, each query row's entropy, weight on key 0 and on target keys, summed,
and chosen rows' weights, from queries and keys under the common layout's score function, without forming the
pattern. `attnlens.heads.summarize` calls it where it applies (float32 tensors on the CPU) and keeps its PyTorch path
as the reference and the fallback: the tests hold the two equal.

`paged_rows`: whole pattern rows of decode queries, their keys read in place from vLLM's paged cache (float32 or
bfloat16, no copy of the blocks), for `attnlens serve`'s worker (attnlens/vllm/serving.py), whose PyTorch path (the
keys copied out, then scored: `kept.decode_keys`, `static.decode_patterns`) is the reference and the fallback.

`available()` says whether the kernels are built here and, where they are not, why (no C compiler,
`ATTNLENS_KERNELS=0`); callers then take their PyTorch path, with the same numbers to float32 rounding.

The shared library lands in `$ATTNLENS_CACHE` (default `~/.cache/attnlens`), named by a hash of the source, the flags,
the compiler and this CPU's features, so a cache shared between machines never hands one machine another's code.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("row_statistics.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "library" (a ctypes.CDLL) or "why" (why there is none)


class _Problem(ctypes.Structure):
    """`struct problem` of row_statistics.c, field for field."""

    _fields_ = [
        ("queries", ctypes.c_void_p),
        ("keys", ctypes.c_void_p),
        ("query_strides", ctypes.c_int64 * 3),
        ("key_strides", ctypes.c_int64 * 3),
        *[(name, ctypes.c_int64) for name in ("batch", "heads", "kv_heads", "num_queries", "num_keys", "dim")],
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("window", ctypes.c_int64),
        ("targets", ctypes.c_void_p),
        ("num_targets", ctypes.c_int64),
        ("rows", ctypes.c_void_p),
        ("num_rows", ctypes.c_int64),
        ("sums", ctypes.c_void_p),
        ("row_weights", ctypes.c_void_p),
    ]


class _Paged(ctypes.Structure):
    """`struct paged` of row_statistics.c, field for field."""

    _fields_ = [
        ("queries", ctypes.c_void_p),
        ("query_strides", ctypes.c_int64 * 2),
        ("cache", ctypes.c_void_p),
        ("cache_strides", ctypes.c_int64 * 4),
        ("cache_bfloat16", ctypes.c_int64),
        ("now", ctypes.c_void_p),
        ("now_strides", ctypes.c_int64 * 2),
        ("tables", ctypes.c_void_p),
        ("table_width", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("sinks", ctypes.c_void_p),
        *[(name, ctypes.c_int64) for name in ("batch", "heads", "kv_heads", "dim", "block_size", "num_keys")],
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("window", ctypes.c_int64),
        ("rows", ctypes.c_void_p),
    ]


def _cache() -> Path:
    found = os.environ.get("ATTNLENS_CACHE")
    if found:
        return Path(found)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnlens"


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, ARM
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_features().encode()]))
    target = _cache() / f"row_statistics-{digest.hexdigest()[:20]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # built under a temporary name, then renamed: processes building at once each see a whole library
        handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
        try:
            subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", partial, "-lm"],
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            )
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    library = ctypes.CDLL(str(target))
    library.row_statistics.argtypes = [ctypes.POINTER(_Problem)]
    library.row_statistics.restype = ctypes.c_int
    library.paged_rows.argtypes = [ctypes.POINTER(_Paged)]
    library.paged_rows.restype = ctypes.c_int
    return library


def available() -> str | None:
    """None where the kernels are built and loaded here; else why not (they are then not used)."""
    with _lock:
        if "library" not in _loaded and "why" not in _loaded:
            if os.environ.get("ATTNLENS_KERNELS", "1") == "0":
                _loaded["why"] = "ATTNLENS_KERNELS=0"
            else:
                try:
                    _loaded["library"] = _build()
                except (OSError, subprocess.SubprocessError) as error:
                    detail = getattr(error, "stderr", None) or error
                    _loaded["why"] = f"the C kernels could not be built: {' '.join(str(detail).split())[:500]}"
    return _loaded.get("why")  # type: ignore[return-value]


def row_statistics(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
    targets: torch.Tensor | None = None,
    rows: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per batch element and head of `queries` [batch, heads, rows, dim] (the last rows of `keys` [batch, kv_heads,
    keys, dim], each key/value head serving `heads // kv_heads` consecutive query heads), under the scores `scale *
    q.k`, soft-capped where `softcap`, masked causally within `window` keys: `sums` [batch, heads, 2 + targets] (each
    row's entropy, its weight on key 0 and on each `targets[n][row]` key, summed over the rows; -1: the row does not
    count) and `row_weights` [batch, heads, len(rows), keys], the whole rows `rows` (indexes into the query rows).
    None where the kernel does not apply here (tensors not float32 on the CPU, or `available()` says why not)."""
    if queries.dtype != torch.float32 or keys.dtype != torch.float32 or queries.device.type != "cpu":
        return None
    if keys.device.type != "cpu" or available() is not None:
        return None
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    batch, heads, num_queries, dim = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    targets = (targets if targets is not None else torch.empty(0, num_queries)).to(torch.int64).contiguous()
    chosen = torch.tensor(list(rows), dtype=torch.int64)
    sums = torch.zeros(batch, heads, 2 + len(targets))
    row_weights = torch.zeros(batch, heads, len(chosen), num_keys)
    problem = _Problem(
        queries.data_ptr(),
        keys.data_ptr(),
        (ctypes.c_int64 * 3)(*queries.stride()[:3]),
        (ctypes.c_int64 * 3)(*keys.stride()[:3]),
        batch, heads, kv_heads, num_queries, num_keys, dim,
        scale, softcap or 0.0, window or 0,
        targets.data_ptr(), len(targets), chosen.data_ptr(), len(chosen), sums.data_ptr(), row_weights.data_ptr(),
    )  # fmt: skip
    if _loaded["library"].row_statistics(problem):  # type: ignore[attr-defined]
        raise MemoryError(f"row_statistics: no memory for its scratch ({num_keys} keys x {dim} channels)")
    return sums, row_weights


def paged_rows(
    queries: torch.Tensor,
    blocks: torch.Tensor,
    now: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The pattern rows `[batch, heads, keys]` of one decode query per batch element (`queries` [batch, heads, dim]),
    under the common layout's score function, its keys read in place from a paged cache: `blocks` [blocks, kv_heads,
    slot, dim] (a view of the cache, any strides, float32 or bfloat16: `attnlens.vllm.kept.key_chunks`), the
    element's block ids `tables`
    [batch, width] (int32) for its keys before `positions` [batch], and its own key `now` [batch, kv_heads, dim]. Keys
    run 0 .. max(positions); a row's entries past its position or before its window are 0; `sinks` [heads]: the
    layer's sink logits, in the softmax's denominator. Computed in float32 (bfloat16 keys and queries widened
    exactly). None where the kernel does not apply (a cache neither float32 nor bfloat16, tensors off the CPU, or
    `available()` says why not)."""
    tensors = (queries, blocks, now)
    if blocks.dtype not in (torch.float32, torch.bfloat16) or any(t.device.type != "cpu" for t in tensors):
        return None
    if available() is not None:
        return None
    queries, now = queries.float(), now.float()  # a few rows: widened here, the cache where it lies
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    now = now if now.stride(-1) == 1 else now.contiguous()
    tables = tables.to(torch.int32).contiguous()
    positions = positions.to(torch.int64).contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()
    batch, heads, dim = queries.shape
    num_keys = int(positions.max()) + 1 if batch else 0
    rows = torch.empty(batch, heads, num_keys)
    problem = _Paged(
        queries.data_ptr(), (ctypes.c_int64 * 2)(*queries.stride()[:2]),
        blocks.data_ptr(), (ctypes.c_int64 * 4)(*blocks.stride()), int(blocks.dtype == torch.bfloat16),
        now.data_ptr(), (ctypes.c_int64 * 2)(*now.stride()[:2]),
        tables.data_ptr(), tables.shape[1], positions.data_ptr(), None if sinks is None else sinks.data_ptr(),
        batch, heads, blocks.shape[1], dim, blocks.shape[2], num_keys,
        scale, softcap or 0.0, window or 0, rows.data_ptr(),
    )  # fmt: skip
    if _loaded["library"].paged_rows(problem):  # type: ignore[attr-defined]
        raise MemoryError(f"paged_rows: no memory for its scratch ({num_keys} keys x {heads} heads)")
    return rows
