"""The views a location takes of the tensor the forward holds, one of each: heads split off a flat last axis and
merged back, a batch axis added and dropped, and (on vLLM) every tensor-parallel rank's heads gathered and this rank's
taken back. Each is a `Derived` view or unview: `(envoy, value)` and `(envoy, old, new)`."""

from __future__ import annotations

from typing import Any

import torch

from . import Derived, Location, context


def _heads(envoy) -> Any:
    found = context(envoy)
    return found.geometry(found.layer_of(envoy))


def split_heads(envoy, flat):
    """`[..., heads * head_dim]` as `[..., heads, head_dim]`, the envoy's layer's head size: a view, so in-place edits
    land."""
    return flat.unflatten(-1, (-1, _heads(envoy).head_dim))


def merge_heads(envoy, old, new):
    return new.flatten(-2)


def add_batch(envoy, value):
    return value[None]


def drop_batch(envoy, old, new):
    return new[0]


def copy_with_batch(envoy, value):
    return value[None].clone()


def gather_rank_heads(envoy, flat):
    """vLLM's `[tokens, this rank's heads * head_dim]` as `[1, tokens, heads, head_dim]`, every rank's heads."""
    heads = _heads(envoy)
    return gather_heads(flat.unflatten(-1, (-1, heads.head_dim))[None], heads.num_heads, 2)


def rank_heads(envoy, old, new):
    return local_heads(new, _heads(envoy).num_heads, 2)[0].flatten(-2)


def _clone(envoy, value):
    return value.clone()


def _new(envoy, old, new):
    return new.clone()


def snapshot(source: Location, why: str, label: str = "") -> Derived:
    """`source`'s value as a copy taken when it is produced, for a tensor the forward then changes in place (`why`);
    assigning it still replaces it."""
    return Derived(source, _clone, _new, label, in_place=False, why_not=why)


def unfold_heads(envoy, folded):
    """`[batch * heads, ...]`, the heads folded into the batch (Bloom's, XGLM's arithmetic), as `[batch, heads, ...]`:
    a view."""
    heads = _heads(envoy).num_heads
    return folded.view(folded.shape[0] // heads, heads, *folded.shape[1:])


def fold_heads(envoy, old, new):
    return new.reshape(old.shape)


def batch_folded(source: Location, label: str = "") -> Derived:
    """`source`'s `[batch * heads, ...]` tensor as `[batch, heads, ...]`, a view (assignments fold it back)."""
    return Derived(source, unfold_heads, fold_heads, label)


def per_head(source: Location, **options) -> Derived:
    """`source`'s flat heads `[..., heads * head_dim]` split, a view (assignments merge them back)."""
    return Derived(source, split_heads, merge_heads, **options)


def per_head_on_ranks(source: Location, **options) -> Derived:
    """`source`'s flat heads on vLLM, `[tokens, this rank's heads * head_dim]`, as `[1, tokens, heads, head_dim]`
    over every rank (assignments write this rank's heads back)."""
    return Derived(source, gather_rank_heads, rank_heads, **options)


# --- heads across vLLM's tensor-parallel ranks -----------------------------------------------------------------


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
    if ranks == 1 or x.shape[dim] == total:  # one rank, or heads replicated on every rank: each holds them all
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


def heads_first(flat: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A kernel argument `[tokens, local heads * head_dim]` as `[1, local heads, tokens, head_dim]` (a view)."""
    return flat.view(flat.shape[0], -1, head_dim).transpose(0, 1)[None]


def gathered_heads(flat: torch.Tensor, head_dim: int, total: int) -> torch.Tensor:
    """A kernel argument `[tokens, local heads * head_dim]` as `[1, heads, tokens, head_dim]`, every rank's heads."""
    return gather_heads(heads_first(flat, head_dim), total, 1)


def merge_local(heads: torch.Tensor, total: int) -> torch.Tensor:
    """`[1, heads, tokens, head_dim]` as this rank's kernel argument `[tokens, local heads * head_dim]`."""
    mine = local_heads(heads, total, 1)[0]
    return mine.transpose(0, 1).reshape(mine.shape[1], -1)
