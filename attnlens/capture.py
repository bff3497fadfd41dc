"""Capturing values without writing a trace: `capture_attention`, `run_with_cache` and their helpers.

Both take one prompt or many (a list of any length, batched with left padding; results come back unpadded, one per
prompt), check every request against `support()` before the model runs, and can write results to disk as
safetensors instead of holding them. On a model loaded with `rebuild_patterns=True` the patterns are rebuilt from the
queries and keys, and `capture_attention` computes only the requested rows and heads, in chunks of rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from . import rebuild
from .errors import Unavailable
from .values import ALL_VALUES, BY_NAME

# --- cache names -----------------------------------------------------------------------------------------------

#: Short names for the standardized values (TransformerLens-like; "attn_probs", "value" and "attn_gate" as the spec
#: writes them). A value added to the catalogue without one is cached under its own name.
SHORT = {
    "embeddings": "embed", "layer_input": "resid_pre", "attention_norm_output": "attn_norm",
    "attention_queries": "query", "attention_keys": "key", "attention_values": "value",
    "attention_scores": "attn_scores", "attention_probabilities": "attn_probs", "attention_sinks": "attn_sinks",
    "attention_head_outputs": "z", "attention_gate": "attn_gate", "attention_premix": "premix",
    "attention_output": "attn_out", "layer_mid": "resid_mid", "mlp_norm_output": "mlp_norm", "mlp_input": "mlp_in",
    "mlp_activation": "mlp_act", "mlp_neurons": "mlp_neurons", "mlp_output": "mlp_out", "layer_output": "resid_post",
    "final_norm_output": "final_norm", "logits": "logits",
}
#: Standardized value name -> cache name, for every value of the catalogue.
CACHE_NAMES = {value.name: SHORT.get(value.name, value.name) for value in ALL_VALUES}
#: Not a standardized value: the output of a fused query/key/value projection (`Family.fused_qkv`), for
#: `split_fused_qkv`. Read at the projection, so it comes before the queries.
FUSED = "qkv"
_VALUE_OF = {**{name: name for name in CACHE_NAMES}, **{short: name for name, short in CACHE_NAMES.items()}}
#: Axes that run over positions: unpadding slices them.
POSITION_AXES = ("seq", "query", "key")


def _split_name(name: str, layer: int | None) -> tuple[str, int | None]:
    """("attn_probs.10", None) or ("attn_probs", 10) -> ("attn_probs", 10); also accepts standardized names."""
    if layer is None and "." in name:
        head, _, tail = name.rpartition(".")
        if tail.lstrip("-").isdigit():
            name, layer = head, int(tail)
    if name != FUSED and name not in _VALUE_OF:
        known = ", ".join([*CACHE_NAMES.values(), FUSED])
        raise KeyError(f"{name!r} is not a cache name; known: {known} (or a standardized value name), followed by "
                       f"'.<layer>' for block values")
    short = FUSED if name == FUSED else CACHE_NAMES[_VALUE_OF[name]]
    model_scope = name != FUSED and BY_NAME[_VALUE_OF[short]].scope == "model"
    if model_scope and layer is not None:
        raise KeyError(f"{short!r} is a model value: name it without a layer")
    if not model_scope and layer is None:
        raise KeyError(f"{short!r} is read per block: name a layer, e.g. '{short}.0'")
    return short, layer


def cache_key(name: str, layer: int | None = None) -> str:
    short, layer = _split_name(name, layer)
    return short if layer is None else f"{short}.{layer}"


class Cache:
    """Captured values by cache name: `cache.get("attn_probs", 10)` or `cache["attn_probs.10"]`, batch axis first."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = dict(tensors)

    def get(self, name: str, layer: int | None = None) -> torch.Tensor:
        key = cache_key(name, layer)
        if key not in self._tensors:
            raise KeyError(f"{key!r} was not captured; this cache holds {', '.join(self._tensors) or 'nothing'}: add "
                           f"it to run_with_cache's names")
        return self._tensors[key]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.get(key)

    def __contains__(self, key: str) -> bool:
        return cache_key(key) in self._tensors

    def keys(self):
        return self._tensors.keys()

    def items(self):
        return self._tensors.items()

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{key}: {list(t.shape)}" for key, t in self._tensors.items())
        return f"Cache({shapes})"


# --- what to read, checked before the model runs -----------------------------------------------------------------
# Only the public surface both engines share: support(), order(), num_layers, family, the envoys.


def _layer(model, layer) -> int:
    if not isinstance(layer, int) or not -model.num_layers <= layer < model.num_layers:
        raise IndexError(f"layer must be an int in [0, {model.num_layers}); got {layer!r}")
    return layer % model.num_layers


def _value_reason(model, name: str, layer: int | None) -> str | None:
    """support()'s reason `name` (a standardized value) is unavailable on `layer`, or None."""
    value = BY_NAME[name]
    return model.support(0 if layer is None else layer)[value.name if value.scope == "model" else value.key]


def _value_position(model, name: str, layer: int | None) -> tuple:
    """Where a value falls in the whole forward: (block, rank); model values before and after the blocks."""
    if layer is None:
        return (-1, 0) if name == "embeddings" else (model.num_layers, ["final_norm_output", "logits"].index(name))
    return layer, model.order(layer)[BY_NAME[name].key]


def _reason(model, short: str, layer: int | None) -> str | None:
    if short == FUSED:
        if model.family.fused_qkv is None:
            return (f"the {model.family.name} family has separate query, key and value projections; read "
                    f"'query', 'key' and 'value' instead")
        return None
    return _value_reason(model, _VALUE_OF[short], layer)


def _points(model, names: Iterable[str]) -> list[tuple[str, int | None]]:
    """(cache name, layer) of each name, in forward order; unknown or unavailable names raise here."""
    if isinstance(names, str):
        names = [names]
    points = []
    for name in names:
        short, layer = _split_name(name, None)
        if layer is not None:
            layer = _layer(model, layer)
        reason = _reason(model, short, layer)
        if reason is not None:
            where = short if layer is None else f"{short}.{layer}"
            raise Unavailable(f"{where} on {model.family.name}: {reason}")
        points.append((short, layer))
    return sorted(dict.fromkeys(points), key=lambda point: _position(model, *point))


def _position(model, short: str, layer: int | None) -> tuple:
    if short == FUSED:  # the projection runs before the attention function receives its split
        block, rank = _value_position(model, "attention_queries", layer)
        return block, rank - 0.5
    return _value_position(model, _VALUE_OF[short], layer)


def _read(model, short: str, layer: int | None):
    """Read one point inside a trace."""
    if short == FUSED:
        attn = model.layers[layer].self_attn
        attn.source  # noqa: B018  instrument the attention forward now: values read through it come after
        return getattr(attn, model.family.fused_qkv.module).output
    value = BY_NAME[_VALUE_OF[short]]
    host = {"model": lambda: model, "layer": lambda: model.layers[layer],
            "attention": lambda: model.layers[layer].self_attn, "mlp": lambda: model.layers[layer].mlp}[value.scope]()
    return getattr(host, value.name)


def _unpad(tensor: torch.Tensor, short: str, row: int, pad: int) -> torch.Tensor:
    """Row `row` of a batched value (batch axis kept), without its `pad` left-padding positions; a copy."""
    layout = ("batch", "seq", "fused") if short == FUSED else BY_NAME[_VALUE_OF[short]].layout.split()
    index = [slice(row, row + 1)] + [slice(pad, None) if axis in POSITION_AXES else slice(None)
                                     for axis in layout[1:]]
    return tensor[tuple(index)].clone()


# --- prompts, batches, progress, disk ------------------------------------------------------------------------------


def _as_ids(model, prompt) -> torch.Tensor:
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return model.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
    ids = torch.as_tensor(prompt)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.is_floating_point():
        raise ValueError(f"a prompt is a string or 1-D token ids; got {tuple(ids.shape)} {ids.dtype}")
    return ids


def prompts_of(model, inputs) -> tuple[list[torch.Tensor], bool]:
    """(token ids of each prompt, whether `inputs` is one prompt).

    One prompt: a string, 1-D ids, a [1, seq] tensor or a list of ints. Several: a list (of strings or ids), a
    [batch, seq] tensor, or an encoding with `input_ids` and `attention_mask` (padding is dropped)."""
    if isinstance(inputs, Mapping):
        ids = torch.as_tensor(inputs["input_ids"])
        ids = ids[None] if ids.dim() == 1 else ids
        mask = inputs.get("attention_mask")
        rows = list(ids) if mask is None else [row[torch.as_tensor(m).bool()] for row, m in zip(ids, mask)]
        return rows, len(rows) == 1
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2:
        return list(inputs), inputs.shape[0] == 1
    if isinstance(inputs, (list, tuple)) and not all(isinstance(x, int) for x in inputs):
        return [_as_ids(model, prompt) for prompt in inputs], False
    return [_as_ids(model, inputs)], True


def _batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Prompt indexes in batches of similar lengths (longest first), so little padding is computed."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[at:at + batch_size] for at in range(0, len(order), batch_size)]


def _progress(show: bool | None, total: int, batch_size: int):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    show = total > batch_size if show is None else show
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not show, transient=False)


class Stored(Sequence):
    """Results written to disk, one safetensors file per prompt; indexing loads one prompt's result."""

    def __init__(self, paths: list[Path], load: Callable[[dict], Any]):
        self.paths = paths
        self._load = load

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        from safetensors.torch import load_file

        return self._load(load_file(self.paths[index]))

    def __repr__(self) -> str:
        where = self.paths[0].parent if self.paths else "-"
        return f"Stored({len(self)} results in {where})"


def _run(model, prompts: list[torch.Tensor], collect, *, batch_size: int, progress: bool | None,
         save_to: str | Path | None, kind: str) -> list:
    """Run `prompts` in batches; `collect(indexes, pads)`, called inside each trace with the batch's prompt indexes
    and left padding, returns one flat dict of tensors per prompt. Returns them in prompt order, or their files."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}")
    lengths = [len(ids) for ids in prompts]
    if min(lengths, default=1) == 0:
        raise ValueError("a prompt has no tokens")
    results: list = [None] * len(prompts)
    folder = None if save_to is None else Path(save_to)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    with _progress(progress, len(prompts), batch_size) as bar, torch.no_grad():
        task = bar.add_task(f"attnlens {kind}", total=len(prompts))
        for batch in _batches(lengths, batch_size):
            collected = _requests(model, prompts, batch, collect) if _per_request(model) else \
                _padded(model, prompts, batch, collect)
            for i, flat in zip(batch, collected):
                results[i] = flat if folder is None else _write(folder / f"{i:06d}.safetensors", flat, kind)
            bar.advance(task, len(batch))
    return results


def _per_request(model) -> bool:
    """vLLM serves each prompt as its own request (batch axis 1, no padding); it batches them itself."""
    from .standardized import StandardizedTransformer

    return not isinstance(model, StandardizedTransformer)


def _padded(model, prompts, batch, collect) -> list[dict]:
    """One eager forward over the batch, left-padded."""
    lengths = [len(prompts[i]) for i in batch]
    pads = [max(lengths) - length for length in lengths]
    # nnsight left-pads a list of ids and gives the padded rows mask-derived position ids
    batch_input = prompts[batch[0]][None] if len(batch) == 1 else [prompts[i] for i in batch]
    collected: list[dict] = []
    with model.trace(batch_input):
        collected.extend(collect(batch, pads))
    return collected


def _requests(model, prompts, batch, collect) -> list[dict]:
    """One vLLM request per prompt. The reads run in vLLM's worker, which receives the trace shipped with the
    request, so results come back only through `.save()`."""
    out = []
    for i in batch:
        with model.trace(prompts[i].tolist()):
            collected = list().save()
            collected.extend(collect([i], [0]))
        out.extend(collected)
    return out


def _write(path: Path, flat: dict[str, torch.Tensor], kind: str) -> Path:
    from safetensors.torch import save_file

    save_file({key: t.contiguous() for key, t in flat.items()}, str(path), metadata={"attnlens": kind})
    return path


def _deliver(results: list, single: bool, save_to, load: Callable[[dict], Any]):
    if save_to is not None:
        return Stored(results, load)
    out = [load(flat) for flat in results]
    return out[0] if single else out


# --- run_with_cache ------------------------------------------------------------------------------------------------


def run_with_cache(model, inputs, names: Iterable[str], *, batch_size: int = 8, progress: bool | None = None,
                   save_to: str | Path | None = None):
    """Run `inputs` and return a `Cache` of the named values (`"attn_probs.10"`, `"value.10"`, `"logits"`).

    Values keep their layouts, batch axis first. One prompt or a [batch, seq] tensor gives one `Cache`; a list of
    prompts gives one `Cache` per prompt (batch axis 1, padding removed). Unknown or unavailable names raise before
    the model runs, unavailable ones with `support()`'s reason. `save_to` writes each prompt's cache to a
    safetensors file there and returns a lazy sequence of caches instead.
    """
    points = _points(model, names)
    prompts, single = prompts_of(model, inputs)

    def collect(indexes, pads):
        batch = {(short, layer): _read(model, short, layer) for short, layer in points}
        return [{cache_key(short, layer): _unpad(t, short, row, pad) for (short, layer), t in batch.items()}
                for row, pad in enumerate(pads)]

    results = _run(model, prompts, collect, batch_size=batch_size, progress=progress, save_to=save_to, kind="cache")
    if save_to is None and isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and inputs.shape[0] > 1:
        return Cache({key: torch.cat([flat[key] for flat in results]) for key in results[0]})  # a batch stays one
    return _deliver(results, single, save_to, Cache)


# --- capture_attention -----------------------------------------------------------------------------------------------

KINDS = {"scores": "attention_scores", "probs": "attention_probabilities", "value": "attention_values"}


def _indices(spec, size: int, what: str) -> list[int] | None:
    """None (all), an int, a slice or a sequence of ints -> a list of non-negative indexes below `size`."""
    if spec is None:
        return None
    if isinstance(spec, slice):
        return list(range(size))[spec]
    items = [spec] if isinstance(spec, int) else list(spec)
    for index in items:
        if not isinstance(index, int) or not -size <= index < size:
            raise IndexError(f"{what} {index!r} is out of range for {size}")
    return [index % size for index in items]


def _unflatten(flat: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        layer, kind = key.split(".")
        out.setdefault(int(layer), {})[kind] = tensor
    return dict(sorted(out.items()))


def capture_attention(model, inputs, layers, *, keep: Iterable[str] = ("scores", "probs", "value"), heads=None,
                      rows=None, batch_size: int = 8, chunk_rows: int | None = None, progress: bool | None = None,
                      save_to: str | Path | None = None):
    """Per layer, the scores, the pattern and the values of each prompt: `out[10]["probs"]`.

    Layouts (no batch axis): `"scores"` and `"probs"` [heads, query, key], `"value"` [key, kv_heads, head_dim].
    One prompt gives one such dict; several (a list, a [batch, seq] tensor) give a list with one per prompt.

    - `keep`: which of "scores", "probs", "value" to keep.
    - `heads`, `rows`: keep only these query heads and query rows (an int, a slice or a list; negative rows count
      from each prompt's end, so `rows=-1` is every prompt's last token). The axes stay, in the order given.
    - `chunk_rows`: on a model that rebuilds patterns (`rebuild_patterns=True`), how many query rows to compute at a
      time (default: as many as fit 64 MiB); only the requested rows and heads are ever kept, so the full
      heads x query x key matrix is never formed.
    - `batch_size`, `progress`, `save_to`: as `run_with_cache`.

    Everything requested is checked against `support()` before the model runs.
    """
    keep = tuple(dict.fromkeys([keep] if isinstance(keep, str) else keep))
    unknown = [kind for kind in keep if kind not in KINDS]
    if unknown or not keep:
        raise ValueError(f"keep names some of {list(KINDS)}; got {list(keep)}")
    layers = sorted({_layer(model, layer) for layer in ([layers] if isinstance(layers, int) else layers)})
    for layer in layers:
        for kind in keep:
            reason = _value_reason(model, KINDS[kind], layer)
            if reason is not None:
                raise Unavailable(f"capture_attention {kind!r} of layer {layer} on {model.family.name}: {reason}")
    heads_of = {layer: _indices(heads, model.layers[layer].self_attn.num_heads, "head") for layer in layers}
    prompts, single = prompts_of(model, inputs)
    rows_of = [_indices(rows, len(ids), "row") for ids in prompts]  # checked before the model runs
    family = model.family

    def collect(indexes, pads):
        results = [{} for _ in pads]
        for layer in layers:
            attn = model.layers[layer].self_attn
            rebuilt = _rebuilds(model, layer, keep)
            if rebuilt:
                queries, keys, mask = rebuild.interface_inputs(attn, family, model.config, layer)
            read = {}
            for kind in sorted(keep, key=lambda kind: _value_position(model, KINDS[kind], layer)):  # forward order
                if kind == "value" or not rebuilt:
                    read[kind] = getattr(attn, KINDS[kind])
            values = read.pop("value", None)
            for i, pad in enumerate(pads):
                row_list, head_list = rows_of[indexes[i]], heads_of[layer]
                out = results[i]
                if values is not None:
                    out[f"{layer}.value"] = values[i, :, pad:].transpose(0, 1).clone()
                if rebuilt:
                    own_mask = None if mask is None else mask[i:i + 1 if mask.shape[0] > 1 else 1, :, pad:, pad:]
                    patterns = rebuild.pattern_rows(
                        family, attn._module, layer, queries[i:i + 1, :, pad:], keys[i:i + 1, :, pad:], own_mask,
                        rows=row_list, heads=head_list, chunk_rows=chunk_rows, scores="scores" in keep,
                        probabilities="probs" in keep)
                    for kind, name in (("scores", "scores"), ("probs", "probabilities")):
                        if kind in keep:
                            out[f"{layer}.{kind}"] = patterns[name][0]
                for kind, tensor in read.items():
                    picked = tensor[i, :, :, pad:]
                    if head_list is not None:
                        picked = picked[head_list]
                    picked = picked[:, pad:] if row_list is None else picked[:, [pad + r for r in row_list]]
                    out[f"{layer}.{kind}"] = picked.clone()
        return results

    results = _run(model, prompts, collect, batch_size=batch_size, progress=progress, save_to=save_to,
                   kind="capture")
    return _deliver(results, single, save_to, _unflatten)


# --- helpers -------------------------------------------------------------------------------------------------------


def _group(model, layer: int) -> tuple[int, int]:
    attn = model.layers[layer].self_attn
    return attn.num_heads, attn.num_kv_heads


def _rebuilds(model, layer: int, keep) -> bool:
    """Whether this eager-engine model rebuilds the patterns of `layer` itself, so rows and heads can be computed
    alone (vLLM's backend rebuilds whole patterns on its side; they are sliced here)."""
    return getattr(model, "rebuild_patterns", False) and any(
        rebuild.rebuilds(model, KINDS[kind], layer) for kind in ("scores", "probs") if kind in keep)


def per_head_value(model, cache: Cache, layer: int, *, expand: bool = True) -> torch.Tensor:
    """The values as the family feeds them to attention, [batch, key, heads, head_dim], from `"value.<layer>"`.

    With `expand` (the default) grouped key/value heads are repeated to one per query head, the grouping the
    family's attention uses, so `einsum("bhqk,bkhd->bqhd", probs, value)` is the head outputs (before any output
    gate: see `attn_out_gate`). `expand=False` keeps the key/value heads: [batch, key, kv_heads, head_dim]."""
    layer = _layer(model, layer)
    values = cache.get("value", layer)  # [batch, kv_heads, key, head_dim], as the attention function received them
    num_heads, num_kv_heads = _group(model, layer)
    if values.shape[1] != num_kv_heads:
        raise ValueError(f"'value.{layer}' has {values.shape[1]} heads, but layer {layer} of {model.family.name} "
                         f"has {num_kv_heads} key/value heads: is this cache from this model?")
    if expand:
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
    return values.transpose(1, 2)


def attn_out_gate(model, cache: Cache, layer: int) -> torch.Tensor:
    """The output gate multiplying each head's output, [batch, seq, heads, head_dim], from `"attn_gate.<layer>"`.

    On a gated-attention family (Qwen3-Next, Qwen3.5) the head outputs times this gate, merged, is what the output
    projection receives. A family without a gate raises `attnlens.Unavailable` naming it."""
    layer = _layer(model, layer)
    reason = _value_reason(model, "attention_gate", layer)
    if reason is not None:
        raise Unavailable(f"attn_out_gate: layer {layer} of the {model.family.name} family has no output gate: "
                          f"{reason}")
    return cache.get("attn_gate", layer)


def split_fused_qkv(model, fused: torch.Tensor, layer: int = 0) -> dict[str, torch.Tensor]:
    """Split a fused query/key/value projection's output with the family's own layout.

    `fused` is the projection's output, [..., width] (cache name `"qkv.<layer>"`). Returns
    `{"q": [..., heads, head_dim], "k": [..., kv_heads, head_dim], "v": [..., kv_heads, head_dim]}`, before any
    rotary embedding or norm. Raises on a family without a fused projection and on a tensor of the wrong width."""
    layer = _layer(model, layer)
    layout = model.family.fused_qkv
    if layout is None:
        raise Unavailable(f"split_fused_qkv: the {model.family.name} family has separate query, key and value "
                          f"projections; nothing is fused")
    attn = model.layers[layer].self_attn
    return layout.split(fused, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                        where=f"layer {layer} of the {model.family.name} family")
