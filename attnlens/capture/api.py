"""The two capture functions: `run_with_cache` (any values, by cache name) and `capture_attention` (per layer, the
scores, the pattern and the values, rows and heads computed alone on rebuilt patterns)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from .. import points as plan
from .. import rebuild
from ..errors import Unavailable
from ..inputs import check_layers
from ..names import Cache, cache_key
from ..values import BY_SHORT
from . import runs


def run_with_cache(
    model,
    inputs,
    names: Iterable[str],
    *,
    batch_size: int = 8,
    progress: bool | None = None,
    save_to: str | Path | None = None,
):
    """Run `inputs` and return a `Cache` of the named values (`"attn_probs.10"`, `"value.10"`, `"logits"`).

    Values keep their layouts, batch axis first. One prompt or a [batch, seq] tensor gives one `Cache`; a list of
    prompts gives one `Cache` per prompt (batch axis 1, padding removed). Unknown or unavailable names raise before
    the model runs, unavailable ones with `support()`'s reason. `save_to` writes each prompt's cache to a
    safetensors file there and returns a lazy sequence of caches instead.
    """
    points = plan.points(model, names)
    prompts, single = runs.checked_prompts(model, inputs)

    def collect(indexes, spans):
        batch = {(short, layer): plan.read(model, short, layer) for short, layer in points}
        return [
            {cache_key(short, layer): plan.unpad(t, short, row, span) for (short, layer), t in batch.items()}
            for row, span in enumerate(spans)
        ]

    results = runs.run(model, prompts, collect, batch_size=batch_size, progress=progress, save_to=save_to, kind="cache")
    if save_to is None and isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and inputs.shape[0] > 1:
        return Cache({key: torch.cat([flat[key] for flat in results]) for key in results[0]})  # a batch stays one
    return runs.deliver(results, single, save_to, Cache)


#: capture_attention's keys (the capture spec's) -> the values they hold.
KINDS = {short.removeprefix("attn_"): BY_SHORT[short].name for short in ("attn_scores", "attn_probs", "value")}


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


def capture_attention(
    model,
    inputs,
    layers,
    *,
    keep: Iterable[str] = ("scores", "probs", "value"),
    heads=None,
    rows=None,
    batch_size: int = 8,
    chunk_rows: int | None = None,
    progress: bool | None = None,
    save_to: str | Path | None = None,
):
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
    layers = sorted({model.access.check_layer(layer) for layer in check_layers(layers)})
    for layer in layers:
        for kind in keep:
            reason = model.access.reasons(layer).get(KINDS[kind])
            if reason is not None:
                raise Unavailable(f"capture_attention {kind!r} of layer {layer} on {model.family.name}: {reason}")
    heads_of = {layer: _indices(heads, model.access.geometry(layer).num_heads, "head") for layer in layers}
    prompts, single = runs.checked_prompts(model, inputs)
    rows_of = [_indices(rows, len(ids), "row") for ids in prompts]  # checked before the model runs
    family = model.family

    def collect(indexes, spans):
        results = [{} for _ in spans]
        for layer in layers:
            attn = model.layers[layer].self_attn
            rebuilt = any(
                rebuild.rebuilds(model.access, KINDS[kind], layer) for kind in ("scores", "probs") if kind in keep
            )
            if rebuilt:
                queries, keys, mask = rebuild.interface_inputs(attn, family, model.config, layer)
            read = {}
            for kind in sorted(keep, key=lambda kind: model.access.position(KINDS[kind], layer)):  # forward order
                if kind == "value" or not rebuilt:
                    read[kind] = getattr(attn, KINDS[kind])
            values = read.pop("value", None)
            for i, span in enumerate(spans):
                row_list, head_list = rows_of[indexes[i]], heads_of[layer]
                out = results[i]
                if values is not None:
                    out[f"{layer}.value"] = values[i, :, span].transpose(0, 1).clone()
                if rebuilt:
                    own_mask = None if mask is None else mask[i : i + 1 if mask.shape[0] > 1 else 1, :, span, span]
                    patterns = rebuild.pattern_rows(
                        family,
                        model.access.geometry(layer),
                        model.config,
                        layer,
                        queries[i : i + 1, :, span],
                        keys[i : i + 1, :, span],
                        own_mask,
                        rows=row_list,
                        heads=head_list,
                        chunk_rows=chunk_rows,
                        scores="scores" in keep,
                        probabilities="probs" in keep,
                    )
                    for kind, name in (("scores", "scores"), ("probs", "probabilities")):
                        if kind in keep:
                            out[f"{layer}.{kind}"] = patterns[name][0]
                for kind, tensor in read.items():
                    picked = tensor[i, :, :, span]
                    if head_list is not None:
                        picked = picked[head_list]
                    picked = picked[:, span] if row_list is None else picked[:, [span.start + r for r in row_list]]
                    out[f"{layer}.{kind}"] = picked.clone()
        return results

    results = runs.run(
        model, prompts, collect, batch_size=batch_size, progress=progress, save_to=save_to, kind="capture"
    )
    return runs.deliver(results, single, save_to, _unflatten)
