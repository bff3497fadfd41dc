"""Features reduced at vLLM's attention op, in its worker: static taps (attnlens/vllm/static.py) and a reducer.

On a `StandardizedVLLM` whose static points hold each planned layer's queries and keys (and values, for
`value_norm`), `collect` sends plain vLLM requests, a whole batch per `generate` call, so the engine runs at vLLM's
defaults where it was built so (compiled, prefix caching, chunked prefill). The static recorder hands each step's
captures of a layer to `Reducer`, which gathers a prompt's query chunks (chunked prefill) until its last chunk, then
computes the features there with the traced path's own code (`features.features_of`) and keeps only their numbers,
which `take` hands back (rank 0's: every rank holds the gathered heads, so only rank 0 computes). A prompt whose
features fail is reported by its reason, never stops the batch.

Requests skip reading vLLM's prefix cache (`skip_reading_prefix_cache`): the features sum over every query row, and
the queries of a prefix served from that cache are never computed. They still feed it, as plain requests do.

Features whose values are not tapped at the attention op (head outputs: `head_output_norm`, and
`head_attribution`, which reads the final residual) keep the traced path, on an engine built eagerly.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

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


class Reducer:
    """Installed on the worker's static recorder (`install`): per collect request and planned layer, the queries of
    its chunks so far, then the features once its prompt's last chunk ran; results and errors by tag."""

    def __init__(self, runner: Any, features, options: dict, wants: dict, plan: list) -> None:
        from ..locations import child
        from ..vllm.blocks import attention_block

        self.runner, self.recorder = runner, runner.attnlens_static
        self.features, self.options, self.wants = features, options, wants
        self.plan = dict(plan)  # layer -> the standardized values read there
        family = runner.attnlens.family
        blocks = child(runner.nnsight_model, family.path("layers", "vllm"))
        self.attn = {layer: attention_block(family, blocks[layer]) for layer in self.plan}
        self.here = _rank() == 0
        self.queries: dict[tuple[str, int], torch.Tensor] = {}
        self.results: dict[str, dict] = {}
        self.errors: dict[str, str] = {}

    def __call__(self, request: Any, request_id: str, layer: int, position: int, count: int) -> None:
        tag = self.recorder.tags.get(request_id, "")
        if not tag.startswith(TAG) or layer not in self.plan:
            return
        step = request.steps[-1]
        captured = {
            short: step.pop(f"{short}.{layer}") for short in ("query", "key", "value") if f"{short}.{layer}" in step
        }
        if not self.here or tag in self.errors:
            return
        from .features import features_of

        try:
            queries, earlier = captured["query"], self.queries.pop((tag, layer), None)
            if position:  # a later chunk: the earlier chunks' queries were kept here
                if earlier is None or earlier.shape[2] < position:
                    raise RuntimeError(
                        f"the queries before position {position} were never computed here (served from vLLM's prefix "
                        f"cache?); collect's requests skip reading it"
                    )
                queries = torch.cat([earlier[:, :, :position], queries], dim=2)
            tokens = self.runner.requests[request_id].num_prompt_tokens
            if position + count < tokens:
                self.queries[(tag, layer)] = queries
                return
            values = {
                name: queries if name == "attention_queries" else captured[BY_NAME[name].short]
                for name in self.plan[layer]
            }
            self.results.setdefault(tag, {})[layer] = features_of(
                self.attn[layer], layer, tokens, values, self.features, self.options, self.wants
            )
        except Exception as error:  # noqa: BLE001  one prompt's failure goes to the errors table
            self.errors[tag] = f"{type(error).__name__}: {' '.join(str(error).split())}"
            self.results.pop(tag, None)

    def pop(self, tag: str) -> dict | str:
        for key in [key for key in self.queries if key[0] == tag]:
            del self.queries[key]
        if tag in self.errors:
            return self.errors.pop(tag)
        found = self.results.pop(tag, {})
        if set(found) != set(self.plan):
            return f"RuntimeError: features computed on layers {sorted(found)} of {sorted(self.plan)}"
        return found


def _rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # no group: one rank
        return 0


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
    """Run in each worker (`collective_rpc`): per tag, its {layer: {column: per-head values}} or the reason it failed
    (empty on ranks other than 0); the requests' captures freed."""
    runner = worker.model_runner
    recorder, reducer = runner.attnlens_static, runner.attnlens_static.reduce
    recorder.take([tag for tag in tags if tag in recorder.requests])
    return {tag: reducer.pop(tag) for tag in tags} if reducer.here else {}


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
        found = engine.collective_rpc(take, args=(tags,))[0]
    return [found[tag] for tag in tags]
