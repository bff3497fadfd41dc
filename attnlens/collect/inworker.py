"""Features reduced at vLLM's attention op, in its worker: static taps (attnlens/vllm/static.py) and a reducer.

On a `StandardizedVLLM` whose static points hold each planned layer's queries and keys (and values, for
`value_norm`), `collect` sends plain vLLM requests, a whole batch per `generate` call, so the engine runs at vLLM's
defaults where it was built so (compiled, prefix caching, chunked prefill). At each planned layer's kernel the
static recorder hands the kernel's arguments to `Reducer`, which copies the step's rows of collect's requests once,
keeps a prompt's query chunks (chunked prefill) until its last chunk, holds each prompt's values until its run of
layers that score alike is complete (`heads.score_groups`: a short prompt's layers are scored in one call), then
computes the features there with the traced path's own code (`features.features_of`) and keeps only their numbers,
which `take` hands back. Under tensor parallelism each rank reduces its own heads where the heads score
independently (the common layout's score function), and the client joins the ranks' heads (`joined`); otherwise
every rank gathers the heads and rank 0 reduces. A prompt whose features fail is reported by its reason, never
stops the batch.

Requests skip reading vLLM's prefix cache (`skip_reading_prefix_cache`): the features sum over every query row, and
the queries of a prefix served from that cache are never computed. They still feed it, as plain requests do.

Features whose values are not tapped at the attention op (head outputs: `head_output_norm`, and
`head_attribution`, which reads the final residual) keep the traced path, on an engine built eagerly.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from ..locations.views import gather_heads, tensor_parallel
from ..values import BY_NAME

#: The standardized values the attention op's static taps hold (every family's kernel inputs).
KERNEL_VALUES = ("attention_queries", "attention_keys", "attention_values")
#: Tags of collect's requests (the reducer leaves other requests' captures alone).
TAG = "attnlens-collect-"


def servable(features) -> bool:
    """Whether every feature reads only values tapped at the attention op."""
    return all(name in KERNEL_VALUES for feature in features for name in feature.reads)


def shorts_of(features) -> list[str]:
    """The static taps a collection of `features` needs on a layer: queries and keys always (the recorder reduces
    where it has keys), values where a feature reads them."""
    wanted = {"attention_queries", "attention_keys", *(name for f in features for name in f.reads)}
    return [BY_NAME[name].short for name in KERNEL_VALUES if name in wanted]


def points_for(features, layers=None):
    """`static_points` for `StandardizedVLLM` (`features`: names or `Feature`s): a function of the model (family
    and config known, engine not built) naming the taps of `shorts_of(features)` on each of `layers` (default: every
    layer whose attention op taps them all)."""
    from ..vllm import static
    from .features import resolve

    features = [
        resolve(f)[0] if isinstance(f, str) else f for f in ([features] if isinstance(features, str) else features)
    ]
    shorts = shorts_of(features)

    def names(model) -> list[str]:
        chosen = range(model.num_layers) if layers is None else ([layers] if isinstance(layers, int) else layers)
        found = []
        for layer in chosen:
            layer = model.access.check_layer(layer)
            taps = static.taps(model.family, model.text_config, layer)
            if layers is not None or all(taps.get(short) == "kernel" for short in shorts):
                found += [f"{short}.{layer}" for short in shorts]  # a named layer without them raises in declare
        return found

    return names


def missing_points(model, features, layers) -> list[str]:
    """The static points a reduced collection of `layers` needs that `model` did not declare."""
    declared = set(getattr(model, "static_points", None) or ())
    return [
        f"{short}.{layer}" for layer in layers for short in shorts_of(features) if f"{short}.{layer}" not in declared
    ]


# --- the worker's side -----------------------------------------------------------------------------------------------


#: Score elements (layers x heads x rows x keys) of one prompt's layers reduced together: short prompts stack many
#: layers into one call (the per-call cost of many small tensors is the cost there), long ones few.
GROUP_ELEMENTS = 2**21


class _Prompt:
    """One collect request in the worker: its tokens, its runs of layers reduced together (runs of layers that score
    alike, `heads.score_groups`, split so none exceeds `GROUP_ELEMENTS`), each run's rows so far (`[layers in the
    run, tokens, heads * dim]` per kernel argument, allocated when the run's first layer runs) and how many
    positions each layer has."""

    def __init__(self, tokens: int, groups: list[list[int]], heads) -> None:
        self.tokens = tokens
        self.run_of: dict[int, list[int]] = {}
        for group in groups:
            size = max(1, GROUP_ELEMENTS // (heads(group[0]).num_heads * tokens * tokens))
            for at in range(0, len(group), size):
                run = group[at : at + size]
                self.run_of.update(dict.fromkeys(run, run))
        self.rows: dict[int, dict[str, torch.Tensor]] = {}
        self.filled: dict[int, int] = {}


class Reducer:
    """Installed on the worker's static recorder (`install`): at each planned layer's kernel, it takes the rows of
    collect's requests (the recorder captures none of them), copies each request's rows into its prompt's run of
    layers, and once a run's last layer holds every position of the prompt, computes the features of the run's
    layers together; results and errors by tag."""

    def __init__(self, runner: Any, features, options: dict, wants: dict, plan: list) -> None:
        from ..heads import score_groups
        from ..locations import child
        from ..vllm.blocks import attention_block

        self.runner, self.recorder = runner, runner.attnlens_static
        self.values = runner.attnlens  # WorkerValues: family, geometry, kernels
        self.features, self.options, self.wants = features, options, wants
        self.plan = dict(plan)  # layer -> the standardized values read there
        self.shorts = shorts_of(features)
        family = self.values.family
        blocks = child(runner.nnsight_model, family.path("layers", "vllm"))
        self.attn = {layer: attention_block(family, blocks[layer]) for layer in self.plan}
        self.groups = score_groups(
            family, "vllm", self.values.config, self.values.geometry.__getitem__, list(self.plan)
        )
        ranks, rank = tensor_parallel()
        # each rank reduces its own heads where the heads score independently (the common layout's score function
        # on every planned layer); else every rank gathers them and rank 0 reduces
        self.local = ranks == 1 or all(
            self.values.score_function.layer_key(self.values.config, layer) is not None for layer in self.plan
        )
        self.here = self.local or rank == 0
        self.prompts: dict[str, _Prompt] = {}
        self.results: dict[str, dict] = {}
        self.errors: dict[str, str] = {}

    def __call__(self, layer: int, query, key, value, spans: list) -> list:
        tags = self.recorder.tags
        mine = [span for span in spans if tags.get(span[1], "").startswith(TAG)]
        if not mine:
            return spans
        if layer in self.plan:
            self._take(layer, (query, key, value), mine)
        return [span for span in spans if not tags.get(span[1], "").startswith(TAG)]

    def _take(self, layer: int, arguments: tuple, spans: list) -> None:
        heads = self.values.geometry[layer]
        dims = {"query": heads.qk_head_dim, "key": heads.qk_head_dim, "value": heads.head_dim}
        totals = {"query": heads.num_heads, "key": heads.num_kv_heads, "value": heads.num_kv_heads}
        end = max(start + count for _, _, start, count, _ in spans)
        # this step's rows, `[rows, heads * dim]`: this rank's heads, or every rank's where rank 0 reduces (a
        # collective: every rank gathers)
        step = {
            short: self._heads(argument[:end], dims[short], totals[short])
            for short, argument in zip(("query", "key", "value"), arguments)
            if short in self.shorts
        }
        if not self.here:
            return
        for _, request_id, start, count, position in spans:
            tag = self.recorder.tags[request_id]
            if tag in self.errors:
                continue
            try:
                self._copy(
                    tag,
                    request_id,
                    layer,
                    {short: rows[start : start + count] for short, rows in step.items()},
                    position,
                )
            except Exception as error:  # noqa: BLE001  one prompt's failure goes to the errors table
                self.errors[tag] = f"{type(error).__name__}: {' '.join(str(error).split())}"
                self.results.pop(tag, None)
                self.prompts.pop(tag, None)

    def _heads(self, flat: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        flat = flat.reshape(flat.shape[0], -1)
        return flat if self.local else gather_heads(flat.unflatten(1, (-1, dim)), total, 1).flatten(1)

    def _copy(self, tag: str, request_id: str, layer: int, rows: dict, position: int) -> None:
        """One request's rows of this step on `layer` into its prompt's run; the run reduced once complete."""
        prompt = self.prompts.get(tag)
        if prompt is None:
            tokens = self.runner.requests[request_id].num_prompt_tokens
            prompt = self.prompts[tag] = _Prompt(tokens, self.groups, self.values.geometry.__getitem__)
        if prompt.filled.get(layer, 0) != position:  # the rows before were never computed here
            raise RuntimeError(
                f"layer {layer}'s rows before position {position} were never computed here (served from vLLM's "
                f"prefix cache?); collect's requests skip reading it"
            )
        run = prompt.run_of[layer]
        held = prompt.rows.get(run[0])
        if held is None:
            held = prompt.rows[run[0]] = {
                short: tensor.new_empty(len(run), prompt.tokens, tensor.shape[1]) for short, tensor in rows.items()
            }
        count = next(iter(rows.values())).shape[0]
        for short, tensor in rows.items():
            held[short][run.index(layer), position : position + count] = tensor
        prompt.filled[layer] = position + count
        if layer == run[-1] and prompt.filled[layer] == prompt.tokens:
            self._reduce(tag, prompt.tokens, run, prompt.rows.pop(run[0]))

    def _reduce(self, tag: str, tokens: int, layers: list[int], held: dict) -> None:
        """The features of one prompt on a run of layers that score alike, from their rows as `[layers, heads,
        tokens, dim]`, the queries always among them (they say how many heads this rank holds)."""
        from .features import features_of

        heads = self.values.geometry[layers[0]]
        dims = {"query": heads.qk_head_dim, "key": heads.qk_head_dim, "value": heads.head_dim}
        stacked = {short: rows.unflatten(2, (-1, dims[short])).transpose(1, 2) for short, rows in held.items()}
        values = {name: stacked[BY_NAME[name].short] for name in {*self.plan[layers[0]], "attention_queries"}}
        found = features_of(
            [self.attn[layer] for layer in layers], layers, tokens, values, self.features, self.options, self.wants
        )
        self.results.setdefault(tag, {}).update(found)

    def pop(self, tag: str) -> dict | str:
        self.prompts.pop(tag, None)
        if tag in self.errors:
            return self.errors.pop(tag)
        found = self.results.pop(tag, {})
        if set(found) != set(self.plan):
            return f"RuntimeError: features computed on layers {sorted(found)} of {sorted(self.plan)}"
        return found


def install(worker: Any, features: bytes, options: dict, wants: dict, plan: list) -> None:
    """Run in each worker (`collective_rpc`): the recorder reduces collect's requests from now on. `features` come
    cloudpickled (`pickled`): vLLM's executors pickle arguments plainly, which refuses a feature's lambda."""
    import cloudpickle

    runner = worker.model_runner
    runner.attnlens_static.reduce = Reducer(runner, cloudpickle.loads(features), options, wants, plan)


def pickled(features) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(list(features))


def take(worker: Any, tags: list[str]) -> dict:
    """Run in each worker (`collective_rpc`): per tag, its {layer: {column: values of this rank's heads, or every
    rank's}} or the reason it failed (empty on a rank that reduces nothing); the requests' captures freed."""
    runner = worker.model_runner
    recorder, reducer = runner.attnlens_static, runner.attnlens_static.reduce
    recorder.take([tag for tag in tags if tag in recorder.requests])
    return {tag: reducer.pop(tag) for tag in tags} if reducer.here else {}


def joined(per_rank: list[dict], tag: str) -> dict | str:
    """One prompt's columns from every rank that reduced (in rank order): each rank's heads joined along the head
    axis, or the first rank's reason where one failed."""
    found = [taken[tag] for taken in per_rank if taken]
    failed = [result for result in found if isinstance(result, str)]
    if failed or len(found) == 1:
        return (failed or found)[0]
    return {
        layer: {column: _join([result[layer][column] for result in found]) for column in columns}
        for layer, columns in found[0].items()
    }


def _join(parts: list):
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return [per_head for part in parts for per_head in part]  # a list per head


# --- the client's side ---------------------------------------------------------------------------------------------


def forward(model, prompts: list[list[int]]) -> list[dict | str]:
    """Each prompt's {layer: {column: per-head values}}, or the reason it failed: one plain request each, all in one
    `generate` call, reduced in the worker."""
    from vllm import SamplingParams

    from ..vllm.static import CONFIG_KEY

    engine = model.vllm_entrypoint
    tags = [f"{TAG}{uuid.uuid4().hex}" for _ in prompts]
    params = [
        SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True, extra_args={CONFIG_KEY: tag})
        for tag in tags
    ]
    try:
        engine.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    finally:  # what a failed call left in the worker is freed too
        per_rank = engine.collective_rpc(take, args=(tags,))
    return [joined(per_rank, tag) for tag in tags]
