"""Patterns without eager: `attention_scores` and `attention_probabilities` rebuilt from the queries and keys.

A model running sdpa (transformers' default) never forms the scores or the pattern. With
`StandardizedTransformer(..., rebuild_patterns=True)` they are computed from the queries and keys the attention
function receives, with the family's own score function and the very mask the model passed to that function
(causal, sliding window, padding), then softmaxed in float32 as the eager functions do. They are read-only: an edit
would change nothing the model uses. `support()` notes them as rebuilt.

`pattern_rows` computes any subset of query rows and heads in chunks of rows, so a long context never needs the full
`heads x query x key` matrix (nor its float32 softmax copy) at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import AttnlensError, EditError
from .family import INTERFACE_CALL, Family
from .geometry import HeadGeometry
from .locations import Location, Operation, context

REBUILT = ("attention_scores", "attention_probabilities")
NOTE = (
    "rebuilt, read-only: computed from the queries and keys with the family's score function and the model's "
    "own mask (the model runs {implementation}, which never forms it); edits would not reach the model"
)
#: Elements of one chunk of scores (all heads, a few query rows, every key): 64 MiB in float32.
CHUNK_ELEMENTS = 2**24


def _interface_queries(family: Family, config, layer: int) -> Operation | None:
    location = family.locations_for(config, layer).get("attention_queries")
    if isinstance(location, Operation) and location.path == (INTERFACE_CALL,) and location.part == "arg":
        return location
    return None


def why_not(access, layer: int, reasons: dict[str, str]) -> str | None:
    """Why `layer` cannot have its pattern rebuilt (None: it can). `reasons` are the family's."""
    family, config = access.family, access.config
    if config._attn_implementation == "eager":
        return "the model runs eager, which forms the pattern itself"
    if any(name in reasons for name in ("attention_queries", "attention_keys")):
        return "the queries and keys are unavailable on this layer"
    if not all(name in family.locations_for(config, layer) for name in REBUILT):
        return f"the {family.name} family has no softmax pattern on this layer"
    score_function = family.score_function()
    if score_function.softcap(config, layer) is not None:
        return (
            f"{config._attn_implementation} never applies the {family.name} family's score soft-cap, so this "
            f"model's pattern is not the one the family's score function gives; load with "
            f"attn_implementation='eager'"
        )
    beyond = score_function.beyond_queries_and_keys(config, layer)
    if beyond is not None:
        return (
            f"{beyond}, which the rebuild from the queries and keys leaves out; load with attn_implementation='eager'"
        )
    if _interface_queries(family, config, layer) is None:
        return (
            f"the {family.name} family reads its queries outside the attention function's call, where the mask "
            f"is not at hand; load with attn_implementation='eager'"
        )
    return None


def adjust(access, layer: int, reasons: dict[str, str]) -> dict[str, str]:
    """The family's reasons for `layer`, with the rebuilt values made available (or told why they can't be)."""
    blocker = why_not(access, layer, reasons)
    reasons = dict(reasons)
    for name in REBUILT:
        if name not in reasons:
            continue
        if blocker is None:
            del reasons[name]
        elif access.config._attn_implementation != "eager":
            reasons[name] += f"; rebuild_patterns cannot rebuild it here: {blocker}"
    return reasons


def rebuilds(access, name: str, layer: int | None) -> bool:
    """Whether `name` is served rebuilt on `layer` (opted in, transformers engine, not eager attention, nothing in the
    way)."""
    return (
        access.rebuild_patterns
        and name in REBUILT
        and layer is not None
        and access.engine == "transformers"
        and access.config._attn_implementation != "eager"
        and name not in access.reasons(layer)
    )


def interface_inputs(envoy, family: Family, config, layer: int):
    """(queries, keys, the mask the attention function received) of the attention `envoy`, read in a trace."""
    args, kwargs = _interface_queries(family, config, layer).op(envoy).inputs
    mask = args[4] if len(args) > 4 else kwargs.get("attention_mask")
    return args[1], args[2], mask


def visible(mask) -> torch.Tensor | None:
    """The model's mask as booleans, True where a query sees a key (None: no mask, plain causal)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise AttnlensError(
            f"rebuilding the pattern needs the attention mask as a tensor (or None); the model passed "
            f"a {type(mask).__name__}; load with attn_implementation='sdpa' or 'eager'"
        )
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def key_mask(seen: torch.Tensor | None, offset: int) -> torch.Tensor | None:
    """[batch, key], False for padding: a real key is visible to its own query (the diagonal), and a cached key
    (before the queries) to the first query, as far as any query sees it."""
    if seen is None:
        return None
    square = seen[:, 0, :, offset:].diagonal(dim1=-2, dim2=-1)
    return torch.cat([seen[:, 0, 0, :offset], square], dim=-1)


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive runs of `rows` as (position in rows, first row, length)."""
    runs = []
    for i, row in enumerate(rows):
        if runs and row == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, row, 1))
    return runs


def pattern_rows(
    family: Family,
    geometry: HeadGeometry,
    config,
    layer: int,
    queries: torch.Tensor,
    keys: torch.Tensor,
    mask=None,
    *,
    rows: list[int] | None = None,
    heads: list[int] | None = None,
    chunk_rows: int | None = None,
    scores: bool = True,
    probabilities: bool = True,
    image_of: torch.Tensor | None = None,
    prefix: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Scores and/or probabilities of the query `rows` and `heads` (all by default), [batch, heads, rows, key].

    Rows are computed in chunks of `chunk_rows` consecutive rows (by default as many as fit `CHUNK_ELEMENTS`), each
    against only the keys up to its last row: causal attention masks the rest, whose entries are filled in (the
    dtype's minimum, probability 0). All heads of a chunk are computed, then `heads` are kept: a family's score
    function may treat heads differently (slopes, groups), so it always sees them all.
    """
    batch, num_heads, num_queries, _ = queries.shape
    num_keys, offset = keys.shape[2], keys.shape[2] - queries.shape[2]  # query i sits at key position offset + i
    rows = list(range(num_queries)) if rows is None else rows
    heads = list(range(num_heads)) if heads is None else heads
    chunk_rows = chunk_rows or max(1, CHUNK_ELEMENTS // (batch * num_heads * num_keys))
    seen = visible(mask)
    real = key_mask(seen, offset)  # for score functions that place keys by position (ALiBi)
    dtype, minimum = queries.dtype, torch.finfo(queries.dtype).min
    shape = (batch, len(heads), len(rows), num_keys)
    out = {}
    if scores:
        out["scores"] = queries.new_empty(shape)
    if probabilities:
        out["probabilities"] = queries.new_empty(shape)
    pick = None if heads == list(range(num_heads)) else torch.tensor(heads, device=queries.device)
    score_function = family.score_function()
    score_function.image_of = image_of  # where the prompt's images sit (`Access.image_of`)
    score_function.prefix = prefix  # the prompt's prefix that attends both ways (`Access.prefix`)
    causal = score_function.causal(config)
    # the last key each row sees, where the model's mask lets rows see past themselves (an image's tokens each other)
    reach = None if seen is None else num_keys - 1 - seen.flip(-1).int().argmax(-1).amax(dim=(0, 1))
    for at, first, length in _runs(rows):
        for start in range(first, first + length, chunk_rows):
            stop = min(start + chunk_rows, first + length)
            # the score function places its queries as the last rows of its keys: rows that see past themselves (a
            # bidirectional layer; an image's tokens each other, a prefix) are scored with the rows up to the last
            # key they reach, then cut to their own
            end = stop if causal else num_queries
            if reach is not None:
                end = max(end, min(num_queries, int(reach[start:stop].max()) + 1 - offset))
            elif image_of is not None or prefix is not None:
                end = num_queries
            width = offset + end  # the keys these rows can see
            chunk = score_function.scores(
                geometry,
                config,
                queries[:, :, start:end],
                keys[:, :, :width],
                layer,
                None if real is None else real[:, :width],
            )[:, :, : stop - start]
            if seen is not None:
                chunk = torch.where(seen[:, :, start:stop, :width], chunk, minimum)
            full = chunk.new_full((batch, num_heads, stop - start, num_keys), minimum)
            full[..., :width] = chunk
            if pick is not None:
                full = full[:, pick]
            where = slice(at + start - first, at + stop - first)
            if scores:
                out["scores"][:, :, where] = full
            if probabilities:
                out["probabilities"][:, :, where] = full.softmax(-1, dtype=torch.float32).to(dtype)
    return out


@dataclass(frozen=True)
class Rebuilt(Location):
    """`attention_scores` or `attention_probabilities` rebuilt where the attention function is called; read-only."""

    name: str
    queries: Operation
    implementation: str

    in_place = False
    writable = False

    @property
    def note(self) -> str:
        return NOTE.format(implementation=repr(self.implementation))

    @property
    def why_not(self) -> str:
        return (
            f"it is rebuilt from the queries and keys (rebuild_patterns=True), because the model runs "
            f"{self.implementation!r}, which never forms it (edit the queries or keys, or load with "
            f"attn_implementation='eager' to edit it)"
        )

    @property
    def key(self) -> str:
        return self.queries.key

    def read(self, envoy):
        access = context(envoy)
        layer = access.layer_of(envoy)
        queries, keys, mask = interface_inputs(envoy, access.family, access.config, layer)
        kind = "scores" if self.name == "attention_scores" else "probabilities"
        return pattern_rows(
            access.family,
            access.geometry(layer),
            access.config,
            layer,
            queries,
            keys,
            mask,
            scores=kind == "scores",
            probabilities=kind == "probabilities",
            image_of=access.image_of,
            prefix=access.prefix,
        )[kind]

    def write(self, envoy, value):
        raise EditError(self.why_not)


def location(access, name: str, layer: int | None) -> Rebuilt | None:
    """The rebuilt location of `name` on `layer` where `access` rebuilds it, else None."""
    if not rebuilds(access, name, layer):
        return None
    return Rebuilt(name, _interface_queries(access.family, access.config, layer), access.config._attn_implementation)
