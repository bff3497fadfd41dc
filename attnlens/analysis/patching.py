"""Activation patching and attribution patching between a clean and a corrupted input of the same length.

`patch(model, clean, corrupt, metric, over=...)` runs the corrupted input with one piece of the clean run put back
(a head's output, a head's output at one position, or the residual at one position of a layer) and records
`metric(logits)`; many patches share a forward as rows of one batch, so a grid of L x H costs about L x H / batch
forwards. `attribution_patching` estimates the same grid from one forward and one backward of the corrupted run:
`gradient . (clean - corrupt)`. `agreement` measures how well the two rank the pieces (Spearman's rank correlation).
The metric takes the logits `[batch, seq, vocab]` and returns one number per row (`logit_difference` builds one).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import product

import torch

from ..errors import Unavailable
from .reasons import OVER


def logit_difference(model, target, versus=None, row: int = -1):
    """A metric: `logit(target) - logit(versus)` (or `logit(target)`) at `row`, per batch row."""
    from .attribution import token_id

    t = token_id(model, target)
    v = None if versus is None else token_id(model, versus)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, row].float()
        return last[:, t] - (last[:, v] if v is not None else 0)

    metric.__name__ = f"logit difference at row {row}"
    return metric


@dataclass
class PatchGrid:
    """`values[layer, ...]`: the metric with that piece of the clean run patched into the corrupted one."""

    over: str
    axes: tuple[str, ...]
    values: torch.Tensor
    clean: float
    corrupt: float
    method: str  #: "activation patching" or "attribution patching"
    forwards: int = 0
    layers: list[int] = field(default_factory=list)

    @property
    def effect(self) -> torch.Tensor:
        """The change the patch makes to the corrupted run's metric."""
        return self.values - self.corrupt

    @property
    def recovered(self) -> torch.Tensor:
        """The share of the clean-corrupt gap the patch restores (1: all of it)."""
        return self.effect / (self.clean - self.corrupt)

    def to_rows(self) -> list[dict]:
        out = []
        for index in product(*(range(n) for n in self.values.shape)):
            row = dict(zip(self.axes, index))
            row["layer"] = self.layers[row["layer"]]
            row.update(value=float(self.values[index]), effect=float(self.effect[index]))
            out.append(row)
        return out

    def to_dataframe(self):
        import pandas

        return pandas.DataFrame(self.to_rows())

    def table(self, count: int = 15):
        from rich.table import Table

        table = Table(
            title=f"{self.method} over {self.over} · clean {self.clean:.4f} · corrupt {self.corrupt:.4f}",
            title_justify="left",
        )
        for column in (*self.axes, "metric", "effect"):
            table.add_column(column, justify="right")
        rows = sorted(self.to_rows(), key=lambda row: -abs(row["effect"]))[:count]
        for row in rows:
            table.add_row(*(str(row[axis]) for axis in self.axes), f"{row['value']:.4f}", f"{row['effect']:+.4f}")
        table.caption = f"{self.forwards} forwards" if self.forwards else ""
        return table

    def __rich__(self):
        return self.table()

    def __str__(self) -> str:
        from .results import render

        return render(self.table())

    def plot(self, out, dpi: int = 150):
        from .results import heatmap

        grid = self.effect if self.effect.dim() == 2 else self.effect.sum(-1)
        return heatmap(
            grid,
            out,
            title=f"{self.method} over {self.over}",
            x_label=self.axes[1],
            y_label="layer",
            y_ticks=self.layers,
            dpi=dpi,
            label="effect on the metric",
        )


def _ids(model, text):
    from ..capture import prompts_of

    if isinstance(text, Mapping):  # a multimodal model's inputs: the ids of `_inputs`'s
        text = torch.as_tensor(text["input_ids"]).reshape(-1)
    ids = prompts_of(model, text)[0]
    if len(ids) != 1:
        raise ValueError(f"patching takes one clean and one corrupted prompt; got {len(ids)}")
    return ids[0]


def _inputs(model, prompt) -> dict:
    """What a prompt given as the model's inputs (a processor's output: ids beside the images) holds besides its
    ids, for every forward of it (on the transformers engine)."""
    if not isinstance(prompt, Mapping):
        return {}
    if model.access.engine == "vllm":
        raise ValueError("patching prompts with images runs on the transformers engine")
    return {name: value for name, value in prompt.items() if name != "input_ids"}


def _repeated(inputs: dict, copies: int) -> dict:
    """`inputs` for `copies` batch rows of one prompt: every tensor repeated along its first axis (a batch's images
    and their grids are concatenated in row order)."""
    return {
        name: torch.cat([value] * copies) if isinstance(value, torch.Tensor) and copies > 1 else value
        for name, value in inputs.items()
    }


def _pieces(model, over: str, layers: list[int], length: int) -> list[tuple]:
    _key, _axes = OVER[over]
    pieces = []
    for layer in layers:
        if over == "residual":
            pieces += [(layer, position) for position in range(length)]
            continue
        heads = model.layers[layer].self_attn.num_heads
        if over == "head_positions":
            pieces += [(layer, head, position) for head in range(heads) for position in range(length)]
        else:
            pieces += [(layer, head) for head in range(heads)]
    return pieces


def _check(model, over: str, layers, method: str = "patch") -> list[int]:
    """The layers asked for, each checked against what `support(layer).analyses` says of `method` over `over`."""
    if over not in OVER:
        raise ValueError(f"over must be one of {', '.join(OVER)}; got {over!r}")
    chosen = (
        list(range(model.num_layers))
        if layers is None
        else sorted({model.access.check_layer(layer) for layer in ([layers] if isinstance(layers, int) else layers)})
    )
    for layer in chosen:
        reason = model.support(layer).analyses[f"{method}:{over}"]
        if reason is not None:
            what = method.replace("_", " ")
            raise Unavailable(f"{what} over {over} on layer {layer} of {model.family.name}: {reason}")
    return chosen


def _host(model, layer: int, key: str):
    return (
        (model.layers[layer].self_attn, key.split(".")[1])
        if key.startswith("self_attn.")
        else (model.layers[layer], key)
    )


def clean_values(model, ids, key: str, layers: list[int], inputs: dict | None = None) -> dict[int, torch.Tensor]:
    """`key` of every layer in `layers` on one run of `ids` (with the rest of its `inputs`: its images)."""
    found = {}
    with torch.no_grad(), model.trace(ids[None], **(inputs or {})):
        for layer in layers:
            host, name = _host(model, layer, key)
            found[layer] = getattr(host, name).save()
    return {layer: value.detach() for layer, value in found.items()}


def _write(value, source, b: int, where: tuple, key: str) -> None:
    """Put the piece `where` of `source` (batch row 0) into batch row `b` of `value`."""
    if key == "layer_input" or key.endswith("attention_probabilities"):  # (position,)
        value[b, where[0]] = source[0, where[0]]
    elif len(where) == 1:  # a head, every position
        value[b, :, where[0]] = source[0, :, where[0]]
    else:  # a head at one position
        value[b, where[1], where[0]] = source[0, where[1], where[0]]


def _by_layer(patches: list[list[tuple]]) -> dict[int, list[tuple[int, tuple]]]:
    by_layer: dict[int, list[tuple[int, tuple]]] = {}
    for b, pieces in enumerate(patches):
        for piece in pieces:
            by_layer.setdefault(piece[0], []).append((b, piece[1:]))
    return by_layer


def _run(
    model, ids, metric, key: str, patches: list[list[tuple]], clean: dict, batch: int, inputs=None
) -> torch.Tensor:
    """The metric of each batch row, row b patched with every piece of `patches[b]` from `clean` (every row with the
    rest of the prompt's `inputs`: its images)."""
    by_layer = _by_layer(patches)
    with torch.no_grad(), model.trace(ids[None].expand(len(patches), -1), **_repeated(inputs or {}, len(patches))):
        for layer in sorted(by_layer):
            host, name = _host(model, layer, key)
            value = getattr(host, name)
            for b, where in by_layer[layer]:
                _write(value, clean[layer], b, where, key)
        out = metric(model.logits).save()
    return out.detach().float().cpu()


#: In vLLM's worker: the clean request's values of the latest patching batch, for the patched requests of the same
#: forward to read (each request's body is sent to the worker on its own, so they share no Python variable).
_HANDED: dict = {}


def hand_over(batch: str, layer: int, value: torch.Tensor) -> None:
    """The clean request's `value` of `layer`, kept for the requests of `batch` (the previous batch's dropped)."""
    if _HANDED.get("batch") != batch:
        _HANDED.clear()
        _HANDED["batch"] = batch
    _HANDED[layer] = value.clone()


def handed(batch: str, layer: int) -> torch.Tensor:
    if _HANDED.get("batch") != batch or layer not in _HANDED:
        raise RuntimeError(
            f"patching on vLLM: the clean request's layer {layer} was not in this forward (vLLM scheduled the batch's "
            f"requests apart); use a smaller batch_size"
        )
    return _HANDED[layer]


def _run_requests(model, clean_ids, ids, key: str, patches: list[list[tuple]], layers: list[int]) -> torch.Tensor:
    """vLLM: one batch of requests, the clean prompt's first and then one request of `ids` per entry of `patches`,
    each patched with its pieces from the clean request's values in the same forward. The logits of each request
    (`[requests, 1, vocab]`: vLLM's, the last position's), the clean request's first."""
    by_layer = _by_layer(patches)
    batch = uuid.uuid4().hex
    with torch.no_grad(), model.trace(max_tokens=1, temperature=0.0) as tracer:
        with tracer.invoke(clean_ids.tolist()):
            for layer in layers:
                host, name = _host(model, layer, key)
                hand_over(batch, layer, getattr(host, name))
            logits = model.logits.clone().save()  # saved by every request: comes back as their list, in order
        for b in range(len(patches)):
            with tracer.invoke(ids.tolist()):
                for layer in sorted(by_layer):
                    wanted = [where for row, where in by_layer[layer] if row == b]
                    if wanted:
                        # assigned, not written in place: vLLM's residual values are new tensors (sums of its
                        # (hidden, residual) pair), and an assigned pattern has the head outputs recomputed from it
                        host, name = _host(model, layer, key)
                        value, source = getattr(host, name).clone(), handed(batch, layer)
                        for where in wanted:
                            _write(value, source, 0, where, key)
                        setattr(host, name, value)
                logits = model.logits.clone().save()
    return torch.cat([found.float().cpu() for found in (logits if isinstance(logits, list) else [logits])])


def _patch_requests(model, clean_ids, corrupt_ids, metric, key, pieces, layers, batch_size):
    """vLLM's grid: `batch_size` patched requests per batch beside the clean one (the first batch also runs the
    corrupted prompt unpatched). The metric of the clean run, of the corrupted one, of each patch; the forwards."""
    values, clean, corrupt, forwards = [], None, None, 0
    for start in range(0, len(pieces), batch_size):
        group = [[piece] for piece in pieces[start : start + batch_size]]
        logits = _run_requests(model, clean_ids, corrupt_ids, key, ([[]] if start == 0 else []) + group, layers)
        scores = metric(logits).detach().float()
        if start == 0:
            clean, corrupt, scores = scores[0], scores[1], scores[2:]
        else:
            scores = scores[1:]
        values.append(scores)
        forwards += 1
    return torch.cat(values), float(clean), float(corrupt), forwards


def patch(model, clean, corrupt, metric, over: str = "heads", layers=None, batch_size: int = 16) -> PatchGrid:
    """Activation patching: the metric of the corrupted run with each piece `over` ("heads", "head_positions",
    "residual" positions, "patterns" of each head) of the clean run patched in, `batch_size` patches per forward.
    On a vision-language model, `clean` and `corrupt` may be the model's inputs (a processor's output) holding two
    images at the same token positions: each image token's residual, or each head there, patched from one to the
    other (transformers engine)."""
    chosen = _check(model, over, layers)
    clean_ids, corrupt_ids = _ids(model, clean), _ids(model, corrupt)
    clean_inputs, corrupt_inputs = _inputs(model, clean), _inputs(model, corrupt)
    if clean_ids.shape != corrupt_ids.shape:
        raise ValueError(
            f"the clean and corrupted prompts must have the same length in tokens; got "
            f"{len(clean_ids)} and {len(corrupt_ids)}"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    key, axes = OVER[over]
    pieces = _pieces(model, over, chosen, len(clean_ids))
    if model.access.engine == "vllm":
        values, reference, baseline, forwards = _patch_requests(
            model, clean_ids, corrupt_ids, metric, key, pieces, chosen, batch_size
        )
    else:
        sources = clean_values(model, clean_ids, key, chosen, clean_inputs)
        baseline = float(_run(model, corrupt_ids, metric, key, [[]], sources, 1, corrupt_inputs)[0])
        reference = float(_run(model, clean_ids, metric, key, [[]], sources, 1, clean_inputs)[0])
        found, forwards = [], 2
        for start in range(0, len(pieces), batch_size):
            group = [[piece] for piece in pieces[start : start + batch_size]]
            found.append(_run(model, corrupt_ids, metric, key, group, sources, len(group), corrupt_inputs))
            forwards += 1
        values = torch.cat(found)
    shape = [len(chosen)] + [max(piece[i] for piece in pieces) + 1 for i in range(1, len(axes))]
    return PatchGrid(over, axes, values.view(shape), reference, baseline, "activation patching", forwards, chosen)


def attribution_patching(model, clean, corrupt, metric, over: str = "heads", layers=None) -> PatchGrid:
    """The same grid estimated to first order: `gradient of the metric on the corrupted run . (clean - corrupt)`,
    one forward and one backward (eager only: vLLM runs without gradients)."""
    chosen = _check(model, over, layers, "attribution_patching")
    clean_ids, corrupt_ids = _ids(model, clean), _ids(model, corrupt)
    if clean_ids.shape != corrupt_ids.shape:
        raise ValueError(
            f"the clean and corrupted prompts must have the same length in tokens; got "
            f"{len(clean_ids)} and {len(corrupt_ids)}"
        )
    key, axes = OVER[over]
    sources = clean_values(model, clean_ids, key, chosen)
    reference = _run(model, clean_ids, metric, key, [[]], sources, 1)
    grads, values = {}, {}
    with model.trace(corrupt_ids[None]):
        read = {}
        for layer in chosen:
            host, name = _host(model, layer, key)
            read[layer] = getattr(host, name)
        score = metric(model.logits).sum()
        with score.backward():
            for layer in reversed(chosen):
                grads[layer] = read[layer].grad.save()
        for layer in chosen:
            values[layer] = read[layer].save()
        baseline = score.save()
    grid = []
    for layer in chosen:
        estimate = (grads[layer] * (sources[layer] - values[layer])).detach().float()[0]
        if over == "heads":
            grid.append(estimate.sum((0, 2)))
        elif over == "head_positions":
            grid.append(estimate.sum(-1).T)
        elif over == "residual":
            grid.append(estimate.sum(-1))
        else:
            grid.append(estimate.sum((1, 2)))
    corrupt_metric = float(baseline.detach())
    return PatchGrid(
        over,
        axes,
        torch.stack(grid) + corrupt_metric,
        float(reference[0]),
        corrupt_metric,
        "attribution patching",
        2,
        chosen,
    )


def agreement(a: PatchGrid, b: PatchGrid) -> float:
    """Spearman's rank correlation between two grids' effects, over every piece."""
    x, y = a.effect.flatten(), b.effect.flatten()
    if x.shape != y.shape:
        raise ValueError(f"the grids have different shapes: {list(a.values.shape)} and {list(b.values.shape)}")
    rx, ry = x.argsort().argsort().float(), y.argsort().argsort().float()
    return float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])
