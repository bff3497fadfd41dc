"""Head summaries without the full pattern: per layer and head, what the head's attention does on average.

`head_summaries(model)` reads each layer's queries and keys in a forward and hands them to `summarize`, which scores
them with the family's own score function a chunk of query rows at a time, on the model's device, and keeps only sums
per head: the full `heads x query x key` pattern never exists. The summaries (`METRICS`):

- on the text (the prompts given, or the repeated sequences when none are): each row's entropy and its weight on the
  first token (the sink), and the top-k keys of chosen rows;
- on prompts with images (each given as the model's inputs: input_ids, pixel_values and the rest; transformers engine),
  `image`: the share of attention text rows give the image tokens;
- on repeated random tokens, `BOS + R + R` with `R` random of length `n` (the usual head detectors' inputs): the
  previous-token score (row i to key i - 1), the duplicate-token score (a row i of the second copy to i - n, the same
  token's earlier occurrence) and the induction score (to i - n + 1, the token after it).

`summarize` is a pure function of a score function, queries and keys, so it can run wherever those are (vLLM's
worker included). `LayerScores` is the one place that calls `ScoreFunction.scores`. Where a layer scores as the common
layout does and the tensors are float32 on the CPU, `summarize` takes each row's statistics from a compiled kernel
(`attnlens.kernels`), in one pass per row; elsewhere, and as the reference the tests hold it to, from PyTorch a chunk
of rows at a time.
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import gt

import torch

from .errors import Unavailable
from .locations import context

#: Summary name -> what it measures. Every table, CSV column and JSON field is derived from this.
METRICS = {
    "entropy": "mean entropy of a row of the pattern, in nats (0: one key takes all the weight)",
    "sink": "mean weight on the first token",
    "previous": "mean weight from a token to the one before it (repeated random tokens)",
    "duplicate": "mean weight from a token of the second copy to its earlier occurrence, key i - n",
    "induction": "mean weight from a token of the second copy to the token after its earlier occurrence, key i - n + 1",
    "next": "mean weight from a token to the one after it (repeated random tokens; bidirectional layers only)",
    "last": "mean weight on the last token (a BERT-style prompt's [SEP]; bidirectional layers only)",
    "image": "mean weight on image tokens (every image's, a class token included) from a text row after an image "
    "(kind text in model.positions, after the prompt's first image token; image and special rows not counted; "
    "prompts with images only)",
}
#: The metrics only a bidirectional layer has (a causal row sees no later key).
BIDIRECTIONAL = ("next", "last")
#: The metrics only prompts with images have.
ON_IMAGES = ("image",)
#: Measured on the text (prompts, or the repeated sequences without prompts); the others on the repeated sequences.
ON_TEXT = ("entropy", "sink", "last", "image")
#: Averaged over every row; the others over the rows they count (`{metric}_rows`).
EVERY_ROW = ("entropy", "sink", "last")
TARGETED = tuple(name for name in METRICS if name not in ON_TEXT)
#: Elements of one chunk of scores (a batch, all heads, a few rows, the keys they see): 2 MiB in float32. Small chunks
#: stay in the CPU's cache through the passes over them, and a long prompt's later rows are scored against only the
#: keys they see, so its masked half is mostly never computed.
CHUNK_ELEMENTS = 2**19

#: (queries [batch, heads, rows, dim], keys [batch, kv_heads, keys, dim]) -> masked scores [batch, heads, rows, keys],
#: the rows being the last `rows` positions of the keys.
ScoreFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --- the core: a pure function of (score function, queries, keys, options) -----------------------------------------


def summarize(
    scores: ScoreFunction,
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    targets: dict[str, torch.Tensor] | None = None,
    top_rows: Sequence[int] = (),
    top_k: int = 0,
    chunk_rows: int | None = None,
    masses: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Per batch element and head, sums over every row of the pattern `softmax(scores(queries, keys))`, computed a
    chunk of rows at a time.

    `queries` [batch, heads, query, dim] are the last `query` positions of `keys` [batch, kv_heads, key, dim]; the
    batch may be several prompts of one length, or one prompt's layers that share a score function. Each chunk of
    `chunk_rows` rows (default: as many as fit `CHUNK_ELEMENTS` against every key) is scored against only the keys it
    can see, softmaxed in float32 and reduced; nothing larger than a chunk is formed. Returns, each a float32 tensor
    on the queries' device:

    - `rows` [batch]: the rows summed; `entropy` and `sink` [batch, heads]: sums of each row's entropy and of its
      weight on key 0 (and, on a bidirectional layer, `last`: on the last key);
    - for each `targets[name]` ([query] key indexes, -1 where a row does not count): `name` [batch, heads], the sum
      of each counted row's weight on its target, and `name_rows` [batch], the rows counted;
    - with `top_rows` and `top_k`: `top_weights` and `top_keys` [batch, heads, len(top_rows), top_k], the `top_k`
      largest weights of those rows and their key indexes (weight 0 and key -1 past the keys a row sees);
    - for each `masses[name]` = (rows [query], keys [key], booleans): `name` [batch, heads], the sum over those rows
      of each row's weight on those keys together, and `name_rows` [batch], the rows counted.

    A bidirectional score function (`scores.causal` False: an encoder's) lets every row see every key: its rows are
    scored in one chunk (a band's mask places rows by their count from the end), and targets may lie after a row.
    A score function with `image_of` (a multimodal prompt's image positions, where an image's tokens see each other
    both ways) has its chunks end where an image does, so that a row sees its image's later tokens.
    """
    causal = getattr(scores, "causal", True)
    batch, num_heads, num_queries, _ = queries.shape
    num_keys = keys.shape[2]
    offset = num_keys - num_queries  # query i sits at key offset + i
    if offset < 0:
        raise ValueError(
            f"summarize: {num_queries} queries but only {num_keys} keys; the queries are the last positions of the keys"
        )
    device = queries.device
    targets = {name: torch.as_tensor(t, device=device).long() for name, t in (targets or {}).items()}
    out = {"rows": torch.full((batch,), float(num_queries), device=device)}
    for name, target in targets.items():
        # checked in Python, each row's key against its position: a few hundred ints, no tensor operations
        listed = target.tolist() if target.dim() == 1 else None
        last = range(offset, offset + num_queries) if causal else [num_keys - 1] * num_queries
        if listed is None or len(listed) != num_queries or any(map(gt, listed, last)):
            raise ValueError(
                f"summarize: targets[{name!r}] must give one key per query row, at most the row's own "
                f"position{'' if causal else ' (any key: the attention is bidirectional)'} (or -1); got shape "
                f"{tuple(target.shape)}"
            )
        counted = sum(map((0).__le__, listed))  # rows whose key is 0 or more
        out[f"{name}_rows"] = torch.full((batch,), float(counted), device=device)
    masses = {name: (rows.to(device), keys.to(device)) for name, (rows, keys) in (masses or {}).items()}
    for name, (rows, _) in masses.items():
        out[f"{name}_rows"] = torch.full((batch,), float(rows.sum()), device=device)
    top_rows = [row % num_queries for row in top_rows] if top_k else []
    if top_rows:
        out["top_weights"] = torch.zeros(batch, num_heads, len(top_rows), top_k, device=device)
        out["top_keys"] = torch.full((batch, num_heads, len(top_rows), top_k), -1, device=device, dtype=torch.long)
    if not masses and _row_statistics(scores, queries, keys, targets, top_rows, top_k, out):
        return out
    sums = ("entropy", "sink", *targets, *masses) if causal else ("entropy", "sink", "last", *targets, *masses)
    for name in sums:
        out[name] = torch.zeros(batch, num_heads, device=device)
    if not causal:
        chunk_rows = num_queries
    elif chunk_rows is None:  # as many as fit, in chunks of equal size
        chunks = -(-num_queries // max(1, CHUNK_ELEMENTS // (batch * num_heads * num_keys)))
        chunk_rows = -(-num_queries // chunks)
    # each head's keys channel-major: the products then read them as the matrix product wants (a third less time)
    keys = keys.transpose(2, 3).contiguous().transpose(2, 3)
    reach = _reach(getattr(scores, "image_of", None), num_keys) if causal else None
    start = 0
    while start < num_queries:
        stop = min(start + chunk_rows, num_queries)
        while reach is not None and int(reach[offset + start : offset + stop].max()) + 1 - offset > stop:
            stop = int(reach[offset + start : offset + stop].max()) + 1 - offset  # to the end of the image
        width = offset + stop if causal else num_keys  # the keys these rows can see
        chunk = scores(queries[:, :, start:stop], keys[:, :, :width]).float()
        probs = chunk.softmax(-1)
        out["entropy"] += _entropy(chunk, probs).sum(-1)
        out["sink"] += probs[..., 0].sum(-1)
        if not causal:
            out["last"] += probs[..., -1].sum(-1)
        for name, target in targets.items():
            target = target[start:stop]
            index = target.clamp(min=0)[None, None, :, None].expand(batch, num_heads, -1, 1)
            out[name] += (probs.gather(-1, index)[..., 0] * (target >= 0)).sum(-1)
        for name, (rows, on) in masses.items():
            out[name] += (probs @ on[:width].to(probs.dtype) * rows[start:stop]).sum(-1)
        for j, row in enumerate(top_rows):
            if start <= row < stop:
                seen = offset + row + 1 if causal else num_keys  # the keys this row sees
                weights, found = probs[:, :, row - start, :seen].topk(min(top_k, seen), dim=-1)
                out["top_weights"][:, :, j, : found.shape[-1]] = weights
                out["top_keys"][:, :, j, : found.shape[-1]] = found
        start = stop
    return out


def _reach(image_of: torch.Tensor | None, num_keys: int) -> torch.Tensor | None:
    """Per key position, the last key its row sees beyond the causal mask: its image's last token (an image's tokens
    see each other both ways), or itself off images; None without images. `image_of`: [batch, sequence],
    `Positions.image`."""
    if image_of is None or not bool((image_of >= 0).any()):
        return None
    image_of = image_of[:, :num_keys].cpu()
    at = torch.arange(image_of.shape[1]).expand_as(image_of)
    ends = torch.full((image_of.shape[0], int(image_of.max()) + 1), -1).scatter_reduce(
        1, image_of.clamp(min=0), torch.where(image_of >= 0, at, -1), "amax"
    )
    return torch.where(image_of >= 0, ends.gather(1, image_of.clamp(min=0)), at).amax(0)


def _row_statistics(scores, queries, keys, targets, top_rows, top_k, out) -> bool:
    """`summarize`'s sums from the compiled kernel (`attnlens.kernels.row_statistics`: one pass per row, no chunk of
    the pattern formed) into `out`, where the score function is the common layout's and the kernel applies here;
    False where it does not (the PyTorch path below then computes them)."""
    from . import kernels

    layout = getattr(scores, "common_layout", None)
    if layout is None:
        return False
    found = kernels.row_statistics(
        queries, keys, **layout, targets=torch.stack(list(targets.values())) if targets else None, rows=top_rows
    )
    if found is None:
        return False
    sums, row_weights = found
    for n, name in enumerate(("entropy", "sink", *targets)):
        out[name] = sums[..., n]
    offset = keys.shape[2] - queries.shape[2]
    for j, row in enumerate(top_rows):
        seen = offset + row + 1
        weights, found_keys = row_weights[:, :, j, :seen].topk(min(top_k, seen), dim=-1)
        out["top_weights"][:, :, j, : found_keys.shape[-1]] = weights
        out["top_keys"][:, :, j, : found_keys.shape[-1]] = found_keys
    return True


def _entropy(scores: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Each row's entropy, `-sum p log p = logsumexp(s) - sum p s`, with `logsumexp(s) = max s - log max p` (no
    logarithm per entry, one pass fewer than `entr`). Masked scores are the dtype's minimum, where `p s` is -0; a
    score function masking with -inf (0 * -inf) falls back to `entr`."""
    found = scores.amax(-1) - probs.amax(-1).log() - torch.linalg.vecdot(probs, scores)
    if bool(found.isnan().any()):
        return torch.special.entr(probs).sum(-1)
    return found


class LayerScores:
    """A layer's score function as `summarize` takes it: called on (queries, keys), the family's own masked scores
    (scale, grouped heads, soft-cap, mask, sliding window) on unpadded queries and keys; `common_layout` is
    `ScoreFunction.common_layout`'s {scale, softcap, window} where the compiled kernel can score the layer (a causal
    one), else None; `causal` whether a row sees only the keys up to its own; `image_of` where a prompt's images
    sit (`Positions.image`), for a family whose image tokens see each other both ways (its mask then reads it). The
    one place attnlens.heads calls `ScoreFunction.scores`."""

    def __init__(self, function, heads, config, layer: int, image_of: torch.Tensor | None = None) -> None:
        self.function, self.heads, self.config, self.layer = function, heads, config, layer
        self.function.image_of = self.image_of = image_of
        self.causal = function.causal(config)
        plain = self.causal and image_of is None  # the kernel masks causally: no image seen both ways
        self.common_layout = function.common_layout(heads, config, layer) if plain else None

    def __call__(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return self.function.scores(self.heads, self.config, queries, keys, self.layer, None)


def score_function(attn, image_of: torch.Tensor | None = None) -> LayerScores:
    """The score function of the attention envoy `attn` as `summarize` takes it (`image_of`: `LayerScores`'). It
    reads the model's `Access` through the envoy, so it works in vLLM's worker too."""
    access = context(attn)
    layer = access.layer_of(attn)
    function = access.family.score_function(access.engine)
    return LayerScores(function, access.geometry(layer), access.config, layer, image_of)


def why_not(model, layer: int) -> str | None:
    """Why `layer` of `model` cannot be summarised (None: it can)."""
    reasons = model.access.reasons(layer)  # what `support(layer)` reports, without its notes
    for name in ("attention_queries", "attention_keys"):
        if reasons.get(name) is not None:
            return f"{name} unavailable: {reasons[name]}"
    served = model.access.locations(layer)
    if "attention_probabilities" not in served:
        return f"the {model.family.name} family forms no softmax pattern on this layer"
    beyond = model.family.score_function().beyond_queries_and_keys(model.access.config, layer)
    if beyond is not None:
        return (
            f"{beyond}: head summaries score the queries and keys alone, so the family's score function is "
            f"unavailable on this layer"
        )
    return None


# --- inputs: repeated random tokens ---------------------------------------------------------------------------------


def bos_id(model) -> int | None:
    tokenizer = getattr(model, "tokenizer", None)
    found = getattr(tokenizer, "bos_token_id", None)
    return found if found is not None else getattr(model.access.config, "bos_token_id", None)


def repeated_tokens(model, length: int = 50, count: int = 8, seed: int = 0) -> torch.Tensor:
    """`count` sequences `BOS + R + R` (no BOS where the model has none), `R` of `length` random tokens drawn, seeded,
    from the vocabulary without special tokens: [count, 1 + 2 * length]."""
    if length < 2 or count < 1:
        raise ValueError(f"repeated sequences need length >= 2 and count >= 1; got length={length}, count={count}")
    config = model.access.config
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config  # a VLM's text
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    total = 2 * length + (bos_id(model) is not None)
    if limit is not None and total > limit:
        raise ValueError(
            f"repeated sequences of {total} tokens are longer than the model's {limit} positions; "
            f"choose length <= {(limit - 1) // 2}"
        )
    special = list(getattr(getattr(model, "tokenizer", None), "all_special_ids", None) or [])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        found = getattr(config, name, None)
        special += found if isinstance(found, list) else [found]  # (several end-of-sequence ids: a list)
    kept = torch.ones(config.vocab_size, dtype=torch.bool)
    kept[[i for i in special if isinstance(i, int) and 0 <= i < config.vocab_size]] = False
    allowed = kept.nonzero()[:, 0]  # the ids in order (a list of the whole vocabulary was a tenth of the summaries)
    generator = torch.Generator().manual_seed(seed)
    half = allowed[torch.randint(len(allowed), (count, length), generator=generator)]
    sequences = torch.cat([half, half], dim=1)
    bos = bos_id(model)
    if bos is not None:
        sequences = torch.cat([torch.full((count, 1), bos), sequences], dim=1)
    return sequences


def repeat_targets(total: int, length: int, causal: bool = True) -> dict[str, torch.Tensor]:
    """Key index per row of a `[BOS +] R + R` sequence of `total` tokens (-1: the row does not count); on a
    bidirectional model also `next`, the key after each row."""
    rows = torch.arange(total)
    second = rows >= total - length  # the rows of the second copy
    found = {
        "previous": torch.where(rows >= 1, rows - 1, -1),
        "duplicate": torch.where(second, rows - length, -1),
        "induction": torch.where(second, rows - length + 1, -1),
    }
    return found if causal else {**found, "next": torch.where(rows < total - 1, rows + 1, -1)}


# --- the result -----------------------------------------------------------------------------------------------------


@dataclass
class HeadSummaries:
    """Per layer and head, each of `METRICS` the model has (`values[metric][layer]` is a [heads] tensor: `next` and
    `last` on a bidirectional model only) and the top keys."""

    model: str
    layers: list[int]
    values: dict[str, dict[int, torch.Tensor]]
    #: `top[layer]`: one entry per (prompt, row): {"prompt", "row", "keys": [heads][k] of (position, token, weight)}.
    top: dict[int, list[dict]] = field(default_factory=dict)
    #: Layers left out, with the reason.
    skipped: dict[int, str] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    @property
    def metrics(self) -> list[str]:
        """The metrics summarised, in `METRICS`' order."""
        return list(self.values)

    def get(self, metric: str, layer: int) -> torch.Tensor:
        if metric not in METRICS:
            raise KeyError(f"{metric!r} is not a head summary; known: {', '.join(METRICS)}")
        if metric not in self.values:
            if metric in ON_IMAGES:
                raise KeyError(f"{metric!r} is measured on prompts with images only; these held none")
            raise KeyError(f"{metric!r} is measured on bidirectional models only; this one attends causally")
        if layer not in self.values[metric]:
            raise KeyError(
                f"layer {layer} was not summarised; summarised: {self.layers}"
                + (f"; skipped: {self.skipped}" if layer in self.skipped else "")
            )
        return self.values[metric][layer]

    def ranked(self, metric: str, count: int | None = None, *, largest: bool = True) -> list[tuple[int, int]]:
        """(layer, head) pairs by `metric`, largest first (smallest with `largest=False`)."""
        scored = [
            (float(v), layer, head) for layer in self.layers for head, v in enumerate(self.get(metric, layer).tolist())
        ]
        scored.sort(key=lambda item: -item[0] if largest else item[0])
        return [(layer, head) for _, layer, head in scored[:count]]

    def to_rows(self) -> list[dict]:
        """One dict per (layer, head): layer, head, each metric, and `top` (one entry per prompt and row)."""
        rows = []
        for layer in self.layers:
            for head in range(len(self.values["entropy"][layer])):
                row = {"layer": layer, "head": head}
                row.update({metric: round(float(self.values[metric][layer][head]), 6) for metric in self.metrics})
                row["top"] = [
                    {"prompt": entry["prompt"], "row": entry["row"], "keys": entry["keys"][head]}
                    for entry in self.top.get(layer, [])
                ]
                rows.append(row)
        return rows

    def to_csv(self) -> str:
        rows = self.to_rows()
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=["layer", "head", *self.metrics, "top"], lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "top": json.dumps(row["top"], ensure_ascii=False)})
        return buffer.getvalue()

    def to_json(self) -> str:
        return json.dumps(
            {
                "model": self.model,
                "metrics": {metric: METRICS[metric] for metric in self.metrics},
                "settings": self.settings,
                "skipped": {str(k): v for k, v in self.skipped.items()},
                "heads": self.to_rows(),
            },
            ensure_ascii=False,
            indent=1,
        )

    def table(self):
        from rich.table import Table

        table = Table(title=f"head summaries · {self.model}", title_justify="left")
        for column in ("layer", "head", *self.metrics, "top keys (first prompt, row)"):
            table.add_column(column, justify="left" if column.startswith("top") else "right")
        for row in self.to_rows():
            top = row["top"][0]["keys"] if row["top"] else []
            cells = ", ".join(f"{token!r}@{position} {weight:.2f}" for position, token, weight in top)
            table.add_row(str(row["layer"]), str(row["head"]), *(f"{row[m]:.3f}" for m in self.metrics), cells)
        if self.skipped:
            table.caption = "skipped: " + "; ".join(f"layer {k}: {v}" for k, v in self.skipped.items())
        return table

    def __rich__(self):
        return self.table()

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=140, record=True, file=io.StringIO())
        console.print(self.table())
        return console.export_text()


# --- running a model -----------------------------------------------------------------------------------------------


def _layers(model, layers) -> tuple[list[int], dict[int, str]]:
    """The layers to summarise and the ones left out, with reasons. Named layers that cannot be summarised raise."""
    if layers is None:
        reasons = {layer: why_not(model, layer) for layer in range(model.num_layers)}
        kept = [layer for layer, reason in reasons.items() if reason is None]
        if not kept:
            raise Unavailable(
                f"head_summaries: no layer of this {model.family.name} model can be summarised: {reasons[0]}"
            )
        return kept, {layer: reason for layer, reason in reasons.items() if reason is not None}
    chosen = []
    for layer in [layers] if isinstance(layers, int) else list(layers):
        layer = model.access.check_layer(layer)
        reason = why_not(model, layer)
        if reason is not None:
            raise Unavailable(f"head_summaries: layer {layer} on {model.family.name}: {reason}")
        chosen.append(layer)
    return sorted(set(chosen)), {}


def _progress(show: bool | None, total: int):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not (total > 1 if show is None else show),
    )


def _summarise_batch(model, layers, batch_input, spans, options) -> list[dict[int, dict]]:
    """One forward over a padded batch (`spans`: where each prompt lies; on vLLM, one traced request per prompt); per
    prompt, per layer, `summarize`'s sums (computed inside the forward, as each layer's queries and keys are
    formed)."""
    if model.access.engine == "vllm":
        found = []
        for ids, option in zip(batch_input if isinstance(batch_input, list) else list(batch_input), options):
            with torch.no_grad(), model.trace(ids.tolist(), max_tokens=1, temperature=0.0):
                results = [{}].save()
                _collect(model, layers, [slice(0, None)], [option], results)
            found += results
        return found
    results: list[dict[int, dict]] = [{} for _ in spans]
    with torch.no_grad(), model.trace(batch_input):
        _collect(model, layers, spans, options, results)
    return results


def _tapped(model, layers) -> bool:
    """Whether vLLM's attention kernel receives every layer's queries and keys as attnlens serves them, so they can
    be summarised there (`reducer.untapped`); elsewhere each prompt is a trace reading the served values."""
    from .vllm import reducer

    return not any(reducer.untapped(model, layer) for layer in layers)


def _in_worker(model, layers, texts: list[torch.Tensor], options: dict) -> list[dict[int, dict]]:
    """On vLLM: per text, per layer, `summarize`'s sums, computed in vLLM's worker at the attention op
    (`attnlens.vllm.reducer`), one plain request per text, every text in one `generate` call."""
    from functools import partial

    from .vllm import reducer

    plan = {layer: ["attention_queries", "attention_keys"] for layer in layers}
    scores: dict[int, LayerScores] = {}  # per layer, built in the worker once per install
    found = reducer.reduce(
        model,
        partial(_sums_of_run, options=options, scores=scores),
        plan,
        [text.tolist() for text in texts],
        whole_prompts=partial(_sums_of_prompts, options=options, scores=scores),
    )
    failed = [result for result in found if isinstance(result, str)]
    if failed:
        raise RuntimeError(f"head_summaries: a prompt failed in vLLM's worker: {failed[0]}")
    return found


def _sums_of_run(attns, layers, tokens, values, *, options, scores) -> dict[int, dict]:
    """`summarize`'s sums of one prompt on a run of layers that score alike (their queries and keys stacked on the
    batch axis), per layer. `scores`: the install's score functions by layer."""
    return dict(zip(layers, _sums_by_item(_layer_scores(scores, attns[0], layers[0]), values, options)))


def _sums_of_prompts(attn, layer, tokens, values, *, options, scores) -> list[dict]:
    """`summarize`'s sums of prompts of one length on one layer (stacked on the batch axis), per prompt."""
    return _sums_by_item(_layer_scores(scores, attn, layer), values, options)


def _layer_scores(scores: dict, attn, layer: int) -> LayerScores:
    """`score_function(attn)`, built once per layer and install (it is asked for at every layer on every step)."""
    if layer not in scores:
        scores[layer] = score_function(attn)
    return scores[layer]


def _sums_by_item(scores, values, options) -> list[dict]:
    """`summarize`'s sums of what `values` stacks on the batch axis, per item, heads first: `rows` and the targets'
    row counts, the same for every item, as one tensor per count repeated per head and shared by the items."""
    sums = summarize(scores, values["attention_queries"], values["attention_keys"], **options)
    heads = sums["entropy"].shape[1]
    # one unbind per result, not an index per item and result (hundreds of small operations a call); on the CPU
    # without gradients (the worker's case) nothing to detach or copy
    split = {}
    for name, v in sums.items():
        if v.device.type != "cpu" or v.requires_grad:
            v = v.detach().cpu()
        split[name] = v.unbind(0) if v.dim() > 1 else [v[0].expand(heads)] * len(v)
    return [dict(zip(split, one)) for one in zip(*split.values())]


def _collect(model, layers, spans, options, results, image_of=None) -> None:
    """Inside a trace (on vLLM, inside its worker, so only the sums leave it): each layer's sums per prompt
    (`image_of`: the one prompt's images, where its image tokens see each other both ways)."""
    for layer in layers:
        attn = model.layers[layer].self_attn
        order = context(attn).order(layer)
        names = sorted(("attention_queries", "attention_keys"), key=lambda name: order[f"self_attn.{name}"])
        read = {name: getattr(attn, name) for name in names}
        scores = score_function(attn, image_of)
        for i, span in enumerate(spans):
            queries = read["attention_queries"][i : i + 1, :, span]
            keys = read["attention_keys"][i : i + 1, :, span]
            sums = summarize(scores, queries, keys, **options[i])
            results[i][layer] = {name: value[0].detach().cpu() for name, value in sums.items()}  # its one prompt


def _run(model, layers, texts: list[torch.Tensor], options: dict, *, batch_size, bar, description) -> list[dict]:
    """`summarize`'s sums for every text (`options`: summarize's), run in batches of similar lengths; on vLLM, every
    text at once, reduced in its worker."""
    from .capture.runs import batches, spans

    task = bar.add_task(description, total=len(texts))
    if model.access.engine == "vllm" and _tapped(model, layers):
        found = _in_worker(model, layers, texts, options)
        bar.advance(task, len(texts))
        return found
    results: list = [None] * len(texts)
    for batch in batches(model, [len(text) for text in texts], batch_size):
        lengths = [len(texts[i]) for i in batch]
        batch_input = texts[batch[0]][None] if len(batch) == 1 else [texts[i] for i in batch]
        found = _summarise_batch(model, layers, batch_input, spans(model, lengths), [options] * len(batch))
        for i, sums in zip(batch, found):
            results[i] = sums
        bar.advance(task, len(batch))
    return results


def _with_images(model, prompts) -> list[dict] | None:
    """The prompts as the model's inputs, one dict per prompt with input_ids [1, seq], where any is given so (a dict
    holding pixel_values, or another input a tower of the model reads); None where none is (the plain prompts
    `prompts_of` reads, a tokenizer's encoding of several included)."""
    from .capture import prompts_of

    towers = getattr(model.family, "towers", None) or {}
    images = {"pixel_values", *(name for tower in towers.values() for name in tower.inputs)}
    listed = [prompts] if isinstance(prompts, Mapping) else list(prompts) if isinstance(prompts, (list, tuple)) else []
    if not any(isinstance(one, Mapping) and images & set(one) for one in listed):
        return None
    if model.access.engine != "transformers":
        raise Unavailable(
            "head_summaries: prompts with images are summarised on the transformers engine "
            "(attnlens.StandardizedTransformer, eager or sdpa); on vLLM the summaries are computed in its worker "
            "from plain token requests, which carry no images"
        )
    found = []
    for one in listed:
        one = dict(one) if isinstance(one, Mapping) else {"input_ids": prompts_of(model, one)[0][0]}
        ids = torch.as_tensor(one["input_ids"])
        one["input_ids"] = ids[None] if ids.dim() == 1 else ids
        if one["input_ids"].shape[0] != 1:
            raise ValueError(
                f"head_summaries: a prompt with images is one prompt's inputs (input_ids [1, seq]); got input_ids of "
                f"shape {tuple(ids.shape)}: give a list of dicts, one per prompt"
            )
        found.append(one)
    return found


def image_masses(positions, each: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`summarize`'s `masses` for the `image` metric (`METRICS`) of a prompt (`positions`: `model.positions`, row 0):
    "image": (its text rows after the first image token, every image's tokens; no row where it holds no image); with
    `each`, also "image i": (the same rows, image i's tokens) for each image."""
    on_image = positions.image[0] >= 0
    first = int(on_image.nonzero()[0]) if on_image.any() else len(on_image)
    rows = (positions.kind[0] == 0) & (torch.arange(len(on_image)) > first)
    masses = {"image": (rows, on_image)}
    for image in range(len(positions.grids[0]) if each else 0):
        masses[f"image {image}"] = (rows, positions.image[0] == image)
    return masses


def _run_with_images(model, layers, prompts: list[dict], options: dict, *, bar, description) -> list[dict]:
    """`_run` for prompts given as the model's inputs (`_with_images`), a forward each: `model.positions` says
    where its images sit, which the score function masks by (an image's tokens both ways, where the family's do)
    and the `image` metric reads (rows: text after the first image token; keys: every image's tokens)."""
    task = bar.add_task(description, total=len(prompts))
    both_ways = getattr(getattr(model.family, "images", None), "bidirectional", False)
    results = []
    for inputs in prompts:
        positions = model.positions(inputs)
        masses = image_masses(positions)
        image_of = positions.image if both_ways and masses["image"][1].any() else None
        found: list[dict] = [{}]
        rest = {name: value for name, value in inputs.items() if name != "input_ids"}
        with torch.no_grad(), model.trace(inputs["input_ids"], **rest):
            _collect(model, layers, [slice(0, None)], [{**options, "masses": masses}], found, image_of)
        results += found
        bar.advance(task)
    return results


def _token_text(model, ids: Iterable[int]) -> dict[int, str]:
    """Each token id's text, decoded alone, in one call to the tokenizer (a call per token and prompt was a tenth of
    the summaries' time on vLLM)."""
    unique = sorted(set(ids))
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return {i: str(i) for i in unique}
    return dict(zip(unique, tokenizer.batch_decode([[i] for i in unique])))


def head_summaries(
    model,
    prompts=None,
    layers: int | Iterable[int] | None = None,
    *,
    length: int = 50,
    sequences: int = 8,
    seed: int = 0,
    top_k: int = 3,
    rows: int | Sequence[int] = -1,
    chunk_rows: int | None = None,
    batch_size: int = 8,
    progress: bool | None = None,
) -> HeadSummaries:
    """Per layer and head, the summaries of `METRICS`, from the queries and keys, without the full pattern.

    - `prompts`: a prompt or a list of them (strings or token ids); the entropy, the sink and the `top_k` keys of
      `rows` (row indexes of each prompt, negative from its end; default its last) are measured on them. Without
      prompts they are measured on the repeated sequences. A prompt with images is the model's inputs as a dict
      (input_ids [1, seq], pixel_values and the rest its processor gives), a forward each, on the transformers
      engine: its image tokens are masked as the model masks them, and where any prompt holds an image, `image`
      (`METRICS`) is summarised too.
    - `layers`: which layers (default: every layer that can be summarised; the others are listed in `.skipped`).
    - `length`, `sequences`, `seed`: the repeated random sequences `BOS + R + R` (`R` of `length` tokens, `sequences`
      of them) the previous-token, duplicate and induction scores are measured on.
    - `chunk_rows`: query rows scored at a time (default: as many as fit 2 MiB of scores); `batch_size`: prompts per
      forward; `progress`: a rich progress bar on stderr (default: when there is more than one forward).

    Runs on `StandardizedTransformer` (eager or sdpa: only the queries and keys are read) and on `StandardizedVLLM`,
    where the sums are computed inside vLLM's worker at the attention op (on an engine at vLLM's defaults too), one
    plain request per prompt, and only they leave it.
    """
    from .capture import prompts_of

    if top_k < 0 or batch_size < 1:
        raise ValueError(f"top_k must be >= 0 and batch_size >= 1; got top_k={top_k}, batch_size={batch_size}")
    chosen, skipped = _layers(model, layers)
    repeats = list(repeated_tokens(model, length, sequences, seed))
    with_images = _with_images(model, prompts)
    if with_images is not None:
        texts = [inputs["input_ids"][0] for inputs in with_images]
    else:
        texts = prompts_of(model, prompts)[0] if prompts is not None else repeats
    if min(len(ids) for ids in texts) == 0:
        raise ValueError("a prompt has no tokens")
    row_list = [rows] if isinstance(rows, int) else list(rows)
    for ids in texts:
        for row in row_list:
            if not -len(ids) <= row < len(ids):
                raise IndexError(f"row {row} is out of range for a prompt of {len(ids)} tokens")
    causal = model.family.score_function().causal(model.access.config)
    images = with_images is not None and any((model.positions(one).image >= 0).any() for one in with_images)
    metrics = [m for m in METRICS if (not causal or m not in BIDIRECTIONAL) and (images or m not in ON_IMAGES)]
    targets = repeat_targets(len(repeats[0]), length, causal)
    text_options = {"top_rows": row_list, "top_k": top_k, "chunk_rows": chunk_rows}
    repeat_options = {"targets": targets, "chunk_rows": chunk_rows}
    on_prompts = len(texts) if with_images is not None else -(-len(texts) // batch_size)  # a forward per image prompt
    forwards = -(-len(repeats) // batch_size) + (0 if prompts is None else on_prompts)
    with _progress(progress, forwards) as bar:
        if prompts is None:
            on_repeats = on_text = _run(
                model,
                chosen,
                repeats,
                {**repeat_options, **text_options},
                batch_size=batch_size,
                bar=bar,
                description="attnlens heads: repeats",
            )
        else:
            on_repeats = _run(
                model,
                chosen,
                repeats,
                repeat_options,
                batch_size=batch_size,
                bar=bar,
                description="attnlens heads: repeats",
            )
            if with_images is not None:
                on_text = _run_with_images(
                    model, chosen, with_images, text_options, bar=bar, description="attnlens heads: prompts"
                )
            else:
                on_text = _run(
                    model,
                    chosen,
                    texts,
                    text_options,
                    batch_size=batch_size,
                    bar=bar,
                    description="attnlens heads: prompts",
                )

    values: dict[str, dict[int, torch.Tensor]] = {metric: {} for metric in metrics}
    for metric in metrics:
        found = on_text if metric in ON_TEXT else on_repeats
        rows = "rows" if metric in EVERY_ROW else f"{metric}_rows"
        if len({r[layer][metric].shape for r in found for layer in chosen}) == 1:
            # one stack per sum over every text and layer, not a sum per layer and metric (1,200 small operations)
            sums, counts = (
                torch.stack([r[layer][name] for r in found for layer in chosen]).unflatten(0, (len(found), -1)).sum(0)
                for name in (metric, rows)
            )
            counts = counts.reshape(len(chosen), -1)  # a count per text, or per head
            values[metric] = dict(zip(chosen, (sums / counts).unbind(0)))
        else:  # layers with different numbers of heads
            for layer in chosen:
                values[metric][layer] = sum(r[layer][metric] for r in found) / sum(r[layer][rows] for r in found)
    top = _top_entries(model, [ids.tolist() for ids in texts], on_text, chosen, row_list) if top_k else {}
    settings = {
        "length": length,
        "sequences": sequences,
        "seed": seed,
        "top_k": top_k,
        "rows": row_list,
        "prompts": None if prompts is None else len(texts),
    }
    return HeadSummaries(
        model=model_name(model), layers=chosen, values=values, top=top, skipped=skipped, settings=settings
    )


def _top_entries(model, tokens: list[list[int]], found: list[dict], layers: list[int], rows) -> dict[int, list[dict]]:
    """Per layer, per prompt (`tokens`: its ids; `found`: its sums per layer) and row, each head's top keys with a
    weight above 0: position, token text, weight. Every layer's and prompt's heads are read in one flat list (a
    nested `tolist` took 20 times longer; a few operations per prompt and layer, longer still), and only the tokens
    shown are decoded."""
    keys, weights = (
        torch.cat([sums[layer][name] for layer in layers for sums in found]) for name in ("top_keys", "top_weights")
    )
    count = keys.shape[-1]  # [(layer, prompt, head), row, count]
    shown = weights.double().mul(1e6).round().div(1e6).flatten().tolist()  # not one round() per weight
    keys, kept = keys.flatten().tolist(), (weights > 0).flatten().tolist()
    entries: dict[int, list[dict]] = {}
    at = 0  # where this layer's and prompt's first head starts in those lists
    for layer in layers:
        entries[layer] = []
        for p, ids in enumerate(tokens):
            heads = len(found[p][layer]["top_keys"])
            for j, row in enumerate(rows):
                starts = range(at + j * count, at + heads * len(rows) * count, len(rows) * count)  # one per head
                top = [[[keys[i], ids[keys[i]], shown[i]] for i in range(a, a + count) if kept[i]] for a in starts]
                entries[layer].append({"prompt": p, "row": row % len(ids), "keys": top})
            at += heads * len(rows) * count
    shown_keys = [key for table in entries.values() for entry in table for top in entry["keys"] for key in top]
    text = _token_text(model, {key[1] for key in shown_keys})
    for key in shown_keys:  # the token id becomes its text
        key[1] = text[key[1]]
    return entries


def model_name(model) -> str:
    """A short name for titles: the checkpoint's folder or hub name, with the family."""
    config = getattr(model, "config", None) or getattr(model, "text_config", None)
    path = str(getattr(config, "_name_or_path", "") or "")
    name = path.rstrip("/").rsplit("/", 1)[-1] if path else ""
    family = model.family.name
    return f"{name} ({family})" if name else f"a {family} model"


# --- ablation: does a head matter? --------------------------------------------------------------------------------


def repeat_loss(
    model, sequences: torch.Tensor, length: int, ablate: Iterable[tuple[int, int]] = (), *, copy: int = 2
) -> float:
    """The mean cross-entropy of a copy's tokens after its first on `sequences` ([count, total] from
    `repeated_tokens`), with the head outputs of the (layer, head) pairs in `ablate` set to zero. `copy=2` (the
    default): the repeated half, which in-context copying can predict; `copy=1`: the first, which nothing can."""
    if copy not in (1, 2):
        raise ValueError(f"copy is 1 or 2; got {copy!r}")
    by_layer: dict[int, list[int]] = {}
    for layer, head in ablate:
        by_layer.setdefault(layer, []).append(head)
    with torch.no_grad(), model.trace(sequences):
        for layer in sorted(by_layer):
            model.layers[layer].self_attn.attention_head_outputs[:, :, by_layer[layer]] = 0
        logits = model.logits.save()
    total = sequences.shape[1]
    first = total - (3 - copy) * length + 1  # the copy's second token
    predicted = logits[:, first - 1 : first + length - 2].float()
    return float(
        torch.nn.functional.cross_entropy(
            predicted.reshape(-1, predicted.shape[-1]), sequences[:, first : first + length - 1].reshape(-1)
        )
    )


def random_heads(summaries: HeadSummaries, count: int, seed: int) -> list[tuple[int, int]]:
    """`count` (layer, head) pairs drawn, seeded, from the summarised layers' heads."""
    pool = [(layer, head) for layer in summaries.layers for head in range(len(summaries.get("entropy", layer)))]
    return random.Random(seed).sample(pool, count)
