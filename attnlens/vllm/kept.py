"""What vLLM's worker keeps for attnlens, and the helpers the traced and the static paths share: a request's kept keys
and values, the attention kernel's arguments, heads split and gathered across tensor-parallel ranks, and the heads'
sizes read off the kernel.

vLLM's own KV cache holds every earlier key too, but paged and in a backend-specific layout; a copy in the kernel's
own layout, `[tokens, heads * dim]`, is simple and the same on every backend. It lives as long as the request.
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
    num_heads = kernel.num_heads * ranks
    num_kv_heads = kernel.num_kv_heads * ranks
    if ranks > 1:  # kv heads fewer than ranks are replicated (a config with per-layer counts refuses this read)
        num_kv_heads = min(num_kv_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = kernel.head_size
    return HeadGeometry(num_heads, num_kv_heads, head_dim, getattr(kernel, "qk_head_dim", head_dim),
                        float(impl.scale), "vllm")
