"""A request's KV cache as values: the cached keys and values of the positions before this step, and which of them
later steps attend to, read and edited at the attention's input on both engines.

- `attention_cache_keys` `[batch, num_kv_heads, position, qk_head_dim]`, `attention_cache_values`
  `[batch, num_kv_heads, position, head_dim]`: what the cache holds for positions `0 .. position-1` (those the earlier
  steps wrote; keys as the kernel received them, after rotary embedding and any QK-norm: both engines cache rotated
  keys). Positions a sliding window no longer holds read as zeros, and a write must leave them so.
- `attention_cache_visible` `[batch, position]`: True where this step and later ones attend to the position. Assigning
  False at a position removes it from what every later step attends to (its key is masked, as the causal mask masks
  a future one); a removed position cannot be restored.

They are read where the step enters the layer's attention (the attention module's input), before this step's keys
join the cache, so an edit lands in the cache this step then attends to. Each is a copy: assign an edited tensor
(in-place edits of it are refused, as for every copy). On the transformers engine the cache is transformers' own
(`DynamicCache` and its layers: full, sliding-window, and a hybrid's attention layers; `SUPPORTED`); on vLLM it is the
paged cache, read and written through the request's block table by the worker (`attnlens.vllm.kept.RequestCaches`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import EditError, Unavailable
from . import Location, context, insert_after

#: The cache values, in forward order, and what each holds: keys (0), values (1), visibility (2).
NAMES = ("attention_cache_keys", "attention_cache_values", "attention_cache_visible")
#: Why an encoder (a stack that reads its whole input once) serves none of them.
NO_CACHE = "an encoder keeps no KV cache: it runs once, over the whole input"

#: transformers' cache layer classes whose keys and values attnlens reads and edits. Others (static, quantized,
#: offloaded, indexed caches) keep their tensors in layouts or places attnlens does not write to, and are refused.
SUPPORTED = (
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "LinearAttentionAndFullAttentionLayer",
    "LinearAttentionAndSlidingWindowAttentionLayer",
)

#: The attention implementations on which a removed position is masked (the mask argument they take).
MASKED_IMPLEMENTATIONS = ("eager", "sdpa")

WHY_COPY = "it is a copy of the request's KV cache"


def describe(name: str, layer: int) -> str:
    return f"layers[{layer}].self_attn.{name}"


@dataclass(frozen=True)
class CacheEntries(Location):
    """One of the cache values (`NAMES[which]`), at the attention module's input."""

    which: int

    in_place = False
    why_not = WHY_COPY

    @property
    def note(self) -> str:  # type: ignore[override]
        return (
            "the positions before this step; a copy: assign it to edit the cache (transformers' "
            f"{', '.join(SUPPORTED[:2])} layers, or vLLM's paged cache through the request's block table)"
        )

    @property
    def key(self) -> str:
        return ".input"

    def read(self, envoy) -> Any:
        args, kwargs = envoy.inputs  # the step's handoff at this layer's attention: the cache before this step
        layer = context(envoy).layer_of(envoy)
        worker = getattr(envoy.interleaver, "attnlens_worker", None)
        if worker is not None:
            return worker.kv_cache.read(layer, self.which)
        return _Transformers(envoy, layer, args, kwargs).read(self.which)

    def write(self, envoy, value) -> None:
        args, kwargs = envoy.inputs
        layer = context(envoy).layer_of(envoy)
        worker = getattr(envoy.interleaver, "attnlens_worker", None)
        if worker is not None:
            worker.kv_cache.write(layer, self.which, value)
            return
        _Transformers(envoy, layer, args, kwargs).write(self.which, value)


def with_cache(locations: dict) -> dict:
    """`locations` with the cache values at the attention's input, right before the queries, where the layer has
    keys (a recurrent or linear-attention layer has no key/value cache; `unavailable` says why)."""
    if "attention_keys" not in locations or NAMES[0] in locations:
        return locations
    first = next(name for name in ("attention_queries", "attention_keys") if name in locations)
    names = list(locations)
    before = names[names.index(first) - 1] if names.index(first) > 0 else None
    entries = {name: CacheEntries(which) for which, name in enumerate(NAMES)}
    if before is None:
        return {**entries, **locations}
    for name, location in reversed(entries.items()):
        locations = insert_after(locations, before, name, location)
    return locations


def unavailable(family: Any, config: Any, layer: int, engine: str, reasons: dict[str, str]) -> dict[str, str]:
    """`reasons` with why `layer` serves no cache values, in the same words on both engines: no keys (a recurrent
    layer), latent attention, keys shared with an earlier layer, or (visibility, transformers) an attention
    implementation without a mask argument."""
    why = None
    text = config.get_text_config()  # a multimodal model's text model: where the cache is (parts/multimodal.py)
    layer_config = getattr(family, "layer_config", lambda c, i: c)(text, layer)
    shared = getattr(family, "shared_from", None)
    source = shared(text, layer) if shared is not None else None
    if "attention_keys" in reasons:
        why = f"layer {layer} keeps no key/value cache (its attention keys: {reasons['attention_keys']})"
    elif getattr(layer_config, "kv_lora_rank", None):
        why = (
            "latent attention (MLA) caches one compressed latent (and a shared rotary key) per position, not per-head "
            "keys and values; attnlens reads and edits standard key/value caches only"
        )
    elif source is not None:
        why = (
            f"layer {layer} attends with layer {source}'s cached keys and values (shared KV) and caches none of its "
            f"own: read and edit layers[{source}]'s cache, which this layer reads too"
        )
    if why is not None:
        return {**reasons, **dict.fromkeys(NAMES, why)}
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if engine == "transformers" and implementation not in MASKED_IMPLEMENTATIONS:
        reasons = {
            **reasons,
            NAMES[2]: f"a removed position is masked through the attention mask, which the "
            f"{'/'.join(MASKED_IMPLEMENTATIONS)} implementations take; this model runs {implementation!r}",
        }
    return reasons


# --- transformers' cache ----------------------------------------------------------------------------------------


def kept_by(root: Any, family: Any, config: Any, blocks: Any) -> dict[str, str]:
    """Why the model keeps no KV cache at all (the cache values -> the reason), or {} where its attention takes one:
    a model of its own whose attention forward has no cache argument (`CACHE_KEYWORDS`) caches nothing."""
    import inspect

    for layer, block in enumerate(blocks):
        if "attention_keys" not in family.locations_for(config, layer):
            continue
        attention = block.get_submodule(family.path("attention"))
        parameters = inspect.signature(type(attention).forward).parameters
        if any(p.kind is p.VAR_KEYWORD or name in CACHE_KEYWORDS for name, p in parameters.items()):
            return {}
        why = (
            f"the model keeps no KV cache: its attention ({type(attention).__name__}.forward) takes none "
            f"(no argument {', '.join(CACHE_KEYWORDS)}), so every step recomputes the keys and values"
        )
        return dict.fromkeys(NAMES, why)
    return {}


#: The keywords transformers' attention modules take their cache by.
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")


def find_cache(args: tuple, kwargs: dict) -> Any:
    """The `transformers.Cache` an attention module was called with (`cache`, `past_key_values`, `layer_past`), or
    None (a forward without a cache). A cache of another kind (a family's own class) is refused by its class."""
    from transformers.cache_utils import Cache

    found = next((v for v in (*kwargs.values(), *args) if isinstance(v, Cache)), None)
    # an encoder-decoder's (`EncoderDecoderCache`): the decoder's self-attention reads the half it keeps for itself
    found = getattr(found, "self_attention_cache", found)
    if found is None:
        other = next((kwargs[k] for k in CACHE_KEYWORDS if kwargs.get(k) is not None), None)
        empty = other is not None and callable(getattr(other, "get_seq_length", None)) and not other.get_seq_length()
        if other is not None and not empty:  # an empty one holds nothing to read: the prompt's step
            raise Unavailable(
                f"the attention was called with a {type(other).__name__}, not a transformers Cache; attnlens reads "
                f"and edits {', '.join(SUPPORTED)} layers of transformers' caches"
            )
    return found


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states the attention module was called with: its first tensor argument."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    return next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))


def cache_entry(module: torch.nn.Module, args: tuple, kwargs: dict, layer: int) -> Any:
    """The cache layer an attention call reads and writes (None without a cache): the one its `layer_idx` names (an
    argument where one module serves several blocks, Zamba's shared attention; else the module's own)."""
    cache = find_cache(args, kwargs)
    if cache is None:
        return None
    index = kwargs.get("layer_idx", getattr(module, "layer_idx", getattr(module, "layer_id", layer)))
    if isinstance(index, bool) or not isinstance(index, int):
        raise Unavailable(
            f"{describe(NAMES[0], layer)}: the attention of layer {layer} names no cache layer (layer_idx), so "
            f"attnlens cannot tell which of the cache's layers it reads"
        )
    return cache.layers[index] if index < len(cache.layers) else None


class _Transformers:
    """The cache of one attention module's call on the transformers engine."""

    def __init__(self, envoy: Any, layer: int, args: tuple, kwargs: dict) -> None:
        self.envoy, self.layer, self.args, self.kwargs = envoy, layer, args, kwargs
        self.module = envoy._module
        self.hidden = _hidden(args, kwargs)
        if getattr(getattr(context(envoy), "family", None), "time_first", False):  # FSMT's [seq, batch, hidden]
            self.hidden = self.hidden.transpose(0, 1)
        self.entry = cache_entry(self.module, args, kwargs, layer)
        filled = self.entry is not None and getattr(self.entry, "is_initialized", False)
        if filled and type(self.entry).__name__ not in SUPPORTED:
            raise Unavailable(
                f"{describe(NAMES[0], layer)}: the cache of layer {layer} is transformers' "
                f"{type(self.entry).__name__}; attnlens reads and edits {', '.join(SUPPORTED)} (the DynamicCache "
                f"generate builds by default), so run without cache_implementation= or a cache object of that kind"
            )
        filled = filled and getattr(self.entry, "keys", None) is not None
        self.seen = self.entry.get_seq_length() if filled else 0
        self.held = self.entry.keys.shape[-2] if filled and self.seen else 0
        self.start = self.seen - self.held  # positions before `start` left a sliding window
        total = context(envoy).tokens_seen
        if total is not None and total - self.hidden.shape[1] != self.seen:  # not this sequence's cache
            raise Unavailable(
                f"{describe(NAMES[0], layer)}: the cache layer this attention was called with holds "
                f"{self.seen} positions, but the sequence had {total - self.hidden.shape[1]} before this step; "
                f"attnlens serves a cache that holds the sequence's own positions"
            )

    def _empty(self, which: int) -> torch.Tensor:
        heads = context(self.envoy).geometry(self.layer)
        dim = heads.qk_head_dim if which == 0 else heads.head_dim
        return self.hidden.new_zeros(self.hidden.shape[0], heads.num_kv_heads, 0, dim)

    def removed(self) -> torch.Tensor:
        """[batch, seen] True at the positions removed so far."""
        batch = self.hidden.shape[0]
        found = getattr(self.entry, "attnlens_removed", None)
        out = torch.zeros(batch, self.seen, dtype=torch.bool, device=self.hidden.device)
        if found is not None:
            out[:, : found.shape[1]] = found[:, : self.seen]
        return out

    @functools.cached_property
    def repeats(self) -> int:
        """How many copies of each key/value head the cache holds: 1, or the group size where transformers caches
        keys already repeated per query head (Falcon's new decoder architecture), each head's copies side by side."""
        cached, heads = self.entry.keys.shape[1], context(self.envoy).geometry(self.layer).num_kv_heads
        return cached // heads if cached != heads and cached % heads == 0 else 1

    def _heads(self, held: torch.Tensor) -> torch.Tensor:
        return held[:, :: self.repeats] if self.repeats > 1 else held

    def read(self, which: int) -> torch.Tensor:
        if which == 2:
            visible = ~self.removed()
            visible[:, : self.start] = False
            return visible
        if not self.seen:
            return self._empty(which)
        held = self._heads((self.entry.keys, self.entry.values)[which])
        if not self.start:
            return held.clone()
        out = held.new_zeros(*held.shape[:2], self.seen, held.shape[-1])
        out[:, :, self.start :] = held
        return out

    def write(self, which: int, new: torch.Tensor) -> None:
        current = self.read(which)
        if which == 2:
            hide = check_visible(current, new, self.layer)
            if not bool(hide.any()):
                return
            slot = mask_slot(self.module, self.args, self.kwargs)
            if slot is None:
                raise EditError(
                    f"{describe(NAMES[2], self.layer)}: {type(self.module).__name__} takes no attention_mask argument, "
                    f"through which attnlens masks a removed position. Nothing was written."
                )
            self.entry.attnlens_removed = hide | self.removed()
            self.module._attnlens_layer = self.layer
            _watch(self.module)
            mask = masked(self.module, self.kwargs, self.args, slot)
            self.envoy.inputs = with_mask(self.args, self.kwargs, slot, mask)
            return
        check_window(current, new, self.start, NAMES[which], self.layer)
        if not self.seen:
            return
        kept = new[:, :, self.start :].repeat_interleave(self.repeats, dim=1).contiguous()
        if which == 0:
            self.entry.keys = kept
        else:
            self.entry.values = kept


def check_window(current: torch.Tensor, new: torch.Tensor, start: int, name: str, layer: int) -> None:
    """A write of cached keys or values that changes a position a sliding window no longer holds is refused."""
    if start and not torch.equal(new[:, :, :start], current[:, :, :start]):
        changed = (new[:, :, :start] != current[:, :, :start]).flatten(0, 1).any(0).nonzero().flatten().tolist()
        raise EditError(
            f"{describe(name, layer)}: position {changed[0]} has left layer {layer}'s sliding window (the cache holds "
            f"positions {start} to {current.shape[2] - 1}); edit only those. Nothing was written."
        )


def check_visible(current: torch.Tensor, new: torch.Tensor, layer: int) -> torch.Tensor:
    """The positions a write of `attention_cache_visible` removes; one that makes a position visible is refused."""
    new = new.bool()
    restored = new & ~current
    if bool(restored.any()):
        position = int(restored.any(0).nonzero()[0])
        raise EditError(
            f"{describe(NAMES[2], layer)}: position {position} is not attended to (removed, or outside the sliding "
            f"window), and a write can only remove positions: write False where a position should be removed and "
            f"leave the rest as read. Nothing was written."
        )
    return current & ~new


def mask_slot(module: torch.nn.Module, args: tuple, kwargs: dict) -> int | str | None:
    """Where this call of `module` holds its `attention_mask`: its keyword, or its position where the block passes it
    so (BERT's blocks: `self.attention(hidden_states, attention_mask, ...)`); None where the attention takes no
    such argument, so that no mask attnlens gives it would reach the scores."""
    if "attention_mask" in kwargs:
        return "attention_mask"
    # the class's own function, unwrapped (transformers' decorators take *args, **kwargs), less `self`
    parameters = list(inspect.signature(inspect.unwrap(type(module).forward)).parameters)[1:]
    if "attention_mask" not in parameters:
        return None
    at = parameters.index("attention_mask")
    return at if at < len(args) else "attention_mask"


def with_mask(args: tuple, kwargs: dict, slot: int | str, mask: torch.Tensor) -> tuple[tuple, dict]:
    """The call's arguments with `mask` in the mask's `slot` (`mask_slot`)."""
    if isinstance(slot, int):
        return (*args[:slot], mask, *args[slot + 1 :]), kwargs
    return args, {**kwargs, slot: mask}


def _watch(module: torch.nn.Module) -> None:
    """Mask the removed positions in every later call of `module` too (a forward pre-hook, added once)."""
    if module.__dict__.get("_attnlens_hides"):
        return
    module._attnlens_hides = True

    def hide(module, args, kwargs):
        if getattr(cache_entry(module, args, kwargs, module._attnlens_layer), "attnlens_removed", None) is None:
            return None
        slot = mask_slot(module, args, kwargs)
        if slot is None:  # (not reached: the write that removed a position checked the same call)
            return None
        return with_mask(args, kwargs, slot, masked(module, kwargs, args, slot))

    module.register_forward_pre_hook(hide, with_kwargs=True)


def masked(module: torch.nn.Module, kwargs: dict, args: tuple = (), slot: int | str = "attention_mask") -> torch.Tensor:
    """The attention mask of this call with the removed positions masked: columns of the cache's removed positions
    hold the dtype's minimum (eager's additive mask) or False (sdpa's boolean one); a call without a mask (sdpa's
    causal shortcut) gets the causal mask built first."""
    hidden = _hidden(args, kwargs)
    entry = cache_entry(module, args, kwargs, module._attnlens_layer)
    removed = entry.attnlens_removed
    batch, queries = hidden.shape[:2]
    seen = entry.get_seq_length() if entry.is_initialized and entry.keys is not None else 0
    held = entry.keys.shape[-2] if seen else 0
    mask = args[slot] if isinstance(slot, int) else kwargs.get(slot)
    keys = held + queries if mask is None else mask.shape[-1]
    first = seen + queries - keys  # the position of the mask's first key column
    if mask is None:
        query_positions = torch.arange(seen, seen + queries, device=hidden.device)[:, None]
        key_positions = torch.arange(first, first + keys, device=hidden.device)[None]
        allowed = key_positions <= query_positions
        window = getattr(entry, "sliding_window", None)
        if window is not None:
            allowed &= query_positions - key_positions < window
        # an attention of its own arithmetic without a config (LED's decoder) adds its mask, as eager does
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None) or "eager"
        mask = (
            allowed
            if implementation == "sdpa"
            else torch.zeros(allowed.shape, dtype=hidden.dtype)
            .masked_fill(~allowed, torch.finfo(hidden.dtype).min)
            .to(hidden.device)
        )
        mask = mask[None, None]
    mask = mask.expand(batch, *mask.shape[1:]).clone()
    fill = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    for row in range(batch):
        columns = removed[min(row, removed.shape[0] - 1)].nonzero().flatten() - first
        columns = columns[(columns >= 0) & (columns < keys)]
        mask[row, :, :, columns] = fill
    return mask
