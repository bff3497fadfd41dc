"""The features a collection computes: per prompt, layer and head, small numbers reduced where the values are.

A `Feature` names the standardized values it reads on a layer (`reads`), the columns it writes (one value per head,
each an Arrow type) and `compute`, which turns one prompt's values into those columns. `compute` runs inside the
trace: on `StandardizedVLLM` inside vLLM's worker, one request at a time, so only the reduced numbers leave it; on
`StandardizedTransformer` on each prompt's unpadded slice of a batch. Everything scored from queries and keys goes
through `attnlens.heads` (`summarize` and `score_function`, the family's own scores): the math lives there once.

The registry is open: `register(Feature(...))` adds one (a per-head attribution total, say), and `collect` takes it
by name like the built-in ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .. import heads, row_features
from ..errors import Unavailable

if TYPE_CHECKING:
    from ..parts.multimodal import Positions

#: Options every feature may read, with their defaults (part of the features' hash).
DEFAULT_OPTIONS = {"top_k": 5, "rows": [-1]}


@dataclass(frozen=True)
class Feature:
    """One feature: `columns` (name -> Arrow type, per head), computed by `compute(context)` -> {column: tensor
    whose first axis is the query heads}, from the standardized values named in `reads`. `scored`: it scores
    queries against keys with the family's score function, so only layers `heads.why_not` accepts serve it."""

    name: str
    description: str
    reads: tuple[str, ...]
    columns: dict[str, str]
    compute: Callable[[Context], dict[str, torch.Tensor]]
    scored: bool = False
    #: A feature that also reads past the last layer (the final norm, the logits; it needs a trace): `prepare(model,
    #: layers)` -> its state (`Context.state`), once, in the client; `finish(model, state, prompt)` in the trace after
    #: the last layer, per prompt (`Prompt`), turns what its `compute` left in each layer's columns into its own.
    prepare: Callable | None = None
    finish: Callable | None = None
    #: `reason(model, layer)`: why the feature is not served on `layer` beyond its reads (None: it is)
    reason: Callable | None = None
    #: `compute` takes several layers at once (`Context.layers`): its values and `summary()` have the layers on their
    #: first axis where one layer's have a batch axis of one, and its columns have them first too. A feature that is
    #: not grouped sees one layer at a time (`Context.one`), as documented above.
    grouped: bool = False


#: Feature name -> Feature, in the order columns are laid out.
FEATURES: dict[str, Feature] = {}


def register(feature: Feature) -> Feature:
    """Add `feature` to the registry (a name already taken raises: features are part of a run's identity)."""
    if feature.name in FEATURES:
        raise ValueError(f"a feature named {feature.name!r} is registered already")
    taken = {column: name for name, f in FEATURES.items() for column in f.columns}
    clash = [column for column in feature.columns if column in taken or column in RESERVED]
    if clash:
        raise ValueError(
            f"feature {feature.name!r}: column(s) {clash} are taken (by "
            f"{', '.join(taken.get(c, 'the row keys') for c in clash)})"
        )
    FEATURES[feature.name] = feature
    return feature


#: Columns every row has (store.py writes them): which prompt, layer and head.
RESERVED = ("prompt", "key", "tokens", "layer", "head", "kv_head")


def resolve(names) -> list[Feature]:
    """Features by name ("all": every registered one), in registry order; unknown names raise listing the known."""
    names = [names] if isinstance(names, str) else list(names)
    if names == ["all"]:
        return list(FEATURES.values())
    unknown = [name for name in names if name not in FEATURES]
    if unknown or not names:
        raise ValueError(f"unknown feature(s) {unknown or '(none given)'}; known: {', '.join(FEATURES)} (or 'all')")
    return [f for f in FEATURES.values() if f.name in names]


#: Features that read only the chosen rows of `Context.summary()` (its top keys): with no other scored feature, only
#: those rows are scored.
CHOSEN_ROWS_ONLY = ("top_keys", "pattern")


def wants_of(features) -> dict[str, bool]:
    """What `Context.summary()` computes for `features`: the previous-token weight, the chosen rows' top keys, and
    sums over every row (`whole`) unless every scored feature reads only the chosen rows."""
    names = [f.name for f in features]
    return {
        "previous": "previous" in names,
        "top": "top_keys" in names,
        "whole": any(f.scored and f.name not in CHOSEN_ROWS_ONLY for f in features),
    }


def rows_of(options: dict, tokens: int) -> list[int]:
    return sorted({row % tokens for row in options["rows"] if -tokens <= row < tokens})


@dataclass
class Prompt:
    """One prompt, as a feature's `finish` sees it: its token ids, chosen rows, the values read after the last layer
    (`FINALS`, batch axis 1, unpadded) and its {layer: columns}, to complete in place."""

    ids: list[int]
    rows: list[int]
    finals: dict[str, torch.Tensor]
    columns: dict[int, dict]


#: What a feature's `finish` reads after the last layer: the last block's output, the final norm's, the logits.
FINALS = ("layer_output", "final_norm_output", "logits")


@dataclass
class Context:
    """One prompt on one layer, as a feature sees it, or on a group of layers that score alike (`layers`; a grouped
    feature's): the values it reads (unpadded; batch axis 1, or the group's layers first), the attention envoys (for
    the family's score function), and the run's options. `summary()` is `heads.summarize`'s sums, computed once for
    every feature that needs them, for the whole group at once."""

    attns: list
    layers: list[int]
    tokens: int
    values: dict[str, torch.Tensor]
    options: dict
    wants: dict = field(default_factory=dict)  # what summary() computes: previous-token targets, top rows
    state: object = None  # the feature's own, from its `prepare`
    _summary: dict | None = None
    #: The prompt's `model.positions` where it holds images (None: a text prompt): which tokens are an image's.
    positions: Positions | None = None

    @property
    def attn(self):
        """The attention envoy of the (first) layer: its score function is the group's."""
        return self.attns[0]

    @property
    def layer(self) -> int:
        if len(self.layers) != 1:
            raise AttributeError(f"this context holds layers {self.layers}: a grouped feature reads `layers`")
        return self.layers[0]

    @property
    def access(self):
        return self.attn.interleaver.attnlens.of(self.attn)

    def images(self) -> int:
        """How many images the prompt shows (0 on a text prompt)."""
        return 0 if self.positions is None else len(self.positions.grids[0])

    def scores(self):
        """The layer's score function as `heads.summarize` takes it, told where the prompt's images sit where the
        family's image tokens see each other both ways (Gemma 3's)."""
        if not self.images():
            return heads.score_function(self.attn)
        both_ways = getattr(getattr(self.access.family, "images", None), "bidirectional", False)
        return heads.score_function(self.attn, self.positions.image if both_ways else None)

    def rows(self) -> list[int]:
        """The chosen query rows of this prompt, as positions (rows past its length are left out)."""
        return rows_of(self.options, self.tokens)

    def summary(self) -> dict[str, torch.Tensor]:
        """`heads.summarize`'s sums over every row; where only the chosen rows' top keys are wanted (`wants["whole"]`
        false), those rows alone, each scored against the keys it sees (linear in the prompt's length, not
        quadratic), and only `top_weights` and `top_keys`."""
        if self._summary is None:
            queries, keys = self.values["attention_queries"], self.values["attention_keys"]
            top_k = self.options["top_k"] if self.wants.get("top") else 0
            scores = self.scores()
            if not self.wants.get("whole", True):
                found = [
                    heads.summarize(
                        scores, queries[:, :, row : row + 1], keys[:, :, : row + 1], top_rows=[0], top_k=top_k
                    )
                    for row in (self.rows() if top_k else ())
                ]
                self._summary = {
                    name: torch.cat([f[name] for f in found], 2) for name in ("top_weights", "top_keys") if found
                }
                return self._summary
            n = queries.shape[2]
            targets = {}
            if self.wants.get("previous"):
                rows = torch.arange(n)
                targets["previous"] = torch.where(rows >= 1, rows - 1, -1)
            masses = heads.image_masses(self.positions, each=True) if self.images() else None
            self._summary = heads.summarize(
                scores, queries, keys, targets=targets, top_rows=self.rows() if top_k else (), top_k=top_k,
                masses=masses,
            )  # fmt: skip
        return self._summary

    def one(self, i: int) -> Context:
        """The group's `i`th layer alone (batch axis one), sharing the group's summary."""
        if len(self.layers) == 1:
            return self
        summary = None if self._summary is None else {name: v[i : i + 1] for name, v in self._summary.items()}
        values = {name: value[i : i + 1] for name, value in self.values.items()}
        return Context(
            [self.attns[i]], [self.layers[i]], self.tokens, values, self.options, self.wants, self.state, summary,
            self.positions,
        )  # fmt: skip

    def per_query_head(self, per_kv_head: torch.Tensor) -> torch.Tensor:
        """[layers, kv_heads] -> [layers, heads]: each query head gets its key/value head's value, grouped as the
        family groups them (`ScoreFunction.repeat_kv`), as many query heads as the layer has."""
        queries = self.values.get("attention_queries")  # this rank's heads, where a rank reduces its own
        num_heads = self.access.geometry(self.layers[0]).num_heads if queries is None else queries.shape[1]
        group = num_heads // per_kv_head.shape[1]
        return self.access.family.score_function().repeat_kv(per_kv_head[..., None, None], group)[..., 0, 0]


def features_of(
    attns: list,
    layers: list[int],
    tokens: int,
    values: dict,
    features,
    options: dict,
    wants: dict,
    states=None,
    positions=None,
) -> dict:
    """One prompt's {layer: {column: per-head values}} on `layers`, a group that scores alike (`heads.score_groups`),
    from its values (the group's layers first, whole prompt), detached on the CPU: in a trace, or in vLLM's worker at
    the attention op (inworker.py). Grouped features compute every layer at once; the others one layer at a time.
    `positions`: the prompt's `model.positions` where it holds images."""
    context = Context(attns, layers, tokens, values, options, wants, positions=positions)
    columns: dict[int, dict] = {layer: {} for layer in layers}
    for feature in features:
        context.state = (states or {}).get(feature.name)
        if feature.grouped:
            for name, value in feature.compute(context).items():
                for layer, one in zip(layers, _detached(value).unbind(0)):
                    columns[layer][name] = one
            continue
        for i, layer in enumerate(layers):
            alone = context.one(i)
            alone.state = context.state
            columns[layer].update({name: _detached(value) for name, value in feature.compute(alone).items()})
    return columns


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu() if value.is_floating_point() else value.detach().cpu()
    return [[_detached(row) for row in per_head] for per_head in value]


def _mean(sums: dict, name: str, rows: str) -> torch.Tensor:
    return sums[name] / sums[rows][:, None]  # 0 / 0 = nan where no row counts (previous on a one-token prompt)


def _top(context: Context) -> dict[str, torch.Tensor]:
    sums = context.summary()
    rows = torch.tensor(context.rows(), dtype=torch.int32)
    layers, num_heads = context.values["attention_queries"].shape[:2]
    if "top_keys" not in sums:  # no row in range
        empty = torch.zeros(layers, num_heads, 0, context.options["top_k"])
        return {"top_rows": rows.expand(layers, num_heads, -1), "top_keys": empty.int(), "top_weights": empty}
    return {
        "top_rows": rows.expand(layers, num_heads, -1),
        "top_keys": sums["top_keys"].int(),
        "top_weights": sums["top_weights"],
    }


def _chosen_patterns(context: Context) -> list[torch.Tensor]:
    """Each chosen row's pattern, [heads, keys the row sees], scored alone by the family's score function."""
    queries, keys = context.values["attention_queries"], context.values["attention_keys"]
    scores = context.scores()
    if scores.image_of is not None:  # an image's tokens see each other both ways: past a row's own position
        on_images = [row for row in context.rows() if scores.image_of[0, row] >= 0]
        if on_images:
            raise Unavailable(
                f"rows {on_images} are image tokens, which see their image's later tokens too (the family's mask); "
                f"pattern, span_mass and lookback read a row up to its own position: choose text rows (rows=)"
            )
    return [
        scores(queries[:, :, row : row + 1], keys[:, :, : row + 1]).softmax(-1, dtype=torch.float32)[0, :, 0]
        for row in context.rows()
    ]


def _pattern(context: Context) -> dict[str, torch.Tensor]:
    found = _chosen_patterns(context)
    num_heads = context.values["attention_queries"].shape[1]
    return {
        "pattern_rows": torch.tensor(context.rows(), dtype=torch.int32).expand(num_heads, -1),
        "pattern": [[row[h] for row in found] for h in range(num_heads)],
    }


def spans_of(options: dict, tokens: int) -> tuple[tuple[int, int], ...]:
    """The run's `spans` on a prompt of `tokens` tokens: each `[start, end)` as Python slices it (negative from the
    prompt's end; end None: to its end), as token ranges."""
    found = []
    for start, end in options.get("spans") or ():
        chosen = range(tokens)[start:end]
        found.append((chosen.start, chosen.stop) if len(chosen) else (0, 0))
    return tuple(found)


def context_of(options: dict, tokens: int) -> int:
    """How many leading tokens of a prompt are the context `lookback` weighs against the rest (`context`: a count,
    negative: all but that many)."""
    return len(range(tokens)[: options.get("context")])


def _row_features(name: str, rows_column: str) -> Callable[[Context], dict[str, torch.Tensor]]:
    """A feature of `attnlens.row_features` (what `attnlens serve` returns per row) on each chosen row: the same
    code on the chosen rows' patterns."""

    def compute(context: Context) -> dict[str, torch.Tensor]:
        rows, tokens = context.rows(), context.tokens
        num_heads = context.values["attention_queries"].shape[1]
        found = _chosen_patterns(context)
        width = rows[-1] + 1 if rows else 0
        pattern = torch.stack([torch.nn.functional.pad(row, (0, width - row.shape[-1])) for row in found], 1)
        request = row_features.Rows(
            torch.tensor(rows), context_of(context.options, tokens) if name == "lookback" else tokens,
            spans_of(context.options, tokens),
        )  # fmt: skip
        if not rows:
            shape = (num_heads, 0, len(request.spans)) if name == "span_mass" else (num_heads, 0)
            array = torch.zeros(shape)
        else:
            array = row_features.compute([name], pattern, request)[name]
        return {rows_column: torch.tensor(rows, dtype=torch.int32).expand(num_heads, -1), name: array}

    return compute


def _norm(name: str, head_axis: int, kv: bool) -> Callable[[Context], dict[str, torch.Tensor]]:
    def compute(context: Context) -> dict[str, torch.Tensor]:
        tensor = context.values[name].float()  # [layers, ...]
        norms = tensor.norm(dim=-1).mean(dim=2 - head_axis)  # the mean over positions of each head's norm
        column = FEATURE_OF[name]
        return {column: context.per_query_head(norms) if kv else norms}

    return compute


QK = ("attention_queries", "attention_keys")
register(
    Feature(
        "entropy",
        "mean entropy of a row of the pattern, in nats",
        QK,
        {"entropy": "float32"},
        lambda c: {"entropy": _mean(c.summary(), "entropy", "rows")},
        scored=True,
        grouped=True,
    )
)
register(
    Feature(
        "sink",
        "mean weight on the first token",
        QK,
        {"sink": "float32"},
        lambda c: {"sink": _mean(c.summary(), "sink", "rows")},
        scored=True,
        grouped=True,
    )
)
register(
    Feature(
        "previous",
        "mean weight from a token to the one before it (nan on a one-token prompt)",
        QK,
        {"previous": "float32"},
        lambda c: {"previous": _mean(c.summary(), "previous", "previous_rows")},
        scored=True,
        grouped=True,
    )
)
register(
    Feature(
        "top_keys",
        "the top_k keys of each chosen row (top_rows) and their weights; -1 and 0 past the keys a row sees",
        QK,
        {"top_rows": "list<int32>", "top_keys": "list<list<int32>>", "top_weights": "list<list<float32>>"},
        _top,
        scored=True,
        grouped=True,
    )
)
register(
    Feature(
        "pattern",
        "each chosen row's pattern (pattern_rows), over the keys it sees",
        QK,
        {"pattern_rows": "list<int32>", "pattern": "list<list<float32>>"},
        _pattern,
        scored=True,
    )
)

#: The norm features: standardized value -> column, and where its head axis is (without the batch axis).
NORMS = {
    "attention_queries": ("query_norm", 0, False),
    "attention_keys": ("key_norm", 0, True),
    "attention_values": ("value_norm", 0, True),
    "attention_head_outputs": ("head_output_norm", 1, False),
}
FEATURE_OF = {name: column for name, (column, _, _) in NORMS.items()}
for _value, (_column, _axis, _kv) in NORMS.items():
    _whose = "its key/value head's, repeated over the query heads it serves" if _kv else "per query head"
    register(
        Feature(
            _column,
            f"mean over positions of the L2 norm of {_value} ({_whose})",
            (_value,),
            {_column: "float32"},
            _norm(_value, _axis, _kv),
            grouped=True,
        )
    )

register(
    Feature(
        "span_mass",
        "each chosen row's (span_rows) weight on each of the run's spans (token ranges, negative from the end)",
        QK,
        {"span_rows": "list<int32>", "span_mass": "list<list<float32>>"},
        _row_features("span_mass", "span_rows"),
        scored=True,
    )
)
register(
    Feature(
        "lookback",
        "each chosen row's (lookback_rows) Lookback Lens ratio: mean weight on a context token / (that + mean weight "
        "on a later token), the context being the run's first `context` tokens; nan where the row sees no later token",
        QK,
        {"lookback_rows": "list<int32>", "lookback": "list<float32>"},
        _row_features("lookback", "lookback_rows"),
        scored=True,
    )
)


def _image_share(context: Context) -> dict[str, torch.Tensor]:
    """The `image` metric of `heads.METRICS` per head, and the same per image: sums of `summarize`'s image masses over
    the rows they count."""
    sums = context.summary()
    layers, num_heads = context.values["attention_queries"].shape[:2]
    if not context.images():
        nothing = torch.full((layers, num_heads), torch.nan)
        return {"image_share": nothing, "image_shares": torch.zeros(layers, num_heads, 0)}
    each = [_mean(sums, f"image {i}", "image_rows") for i in range(context.images())]
    return {"image_share": _mean(sums, "image", "image_rows"), "image_shares": torch.stack(each, -1)}


register(
    Feature(
        "image_share",
        "mean weight on image tokens from a text row after the prompt's first image token (heads' image metric: "
        "model.positions says which tokens are an image's), and the same on each image's tokens (image_shares, "
        "in prompt order); nan (and no image_shares) on a text prompt, nan where no text row follows an image",
        QK,
        {"image_share": "float32", "image_shares": "list<float32>"},
        _image_share,
        scored=True,
        grouped=True,
    )
)
