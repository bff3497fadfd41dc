"""Reductions at vLLM's attention op, in its worker: a tool's plain requests reduced to a few numbers per prompt there.

A tool (`attnlens.collect`, `attnlens.head_summaries`) installs a `Reducer` in every worker (`install`, through
`collective_rpc`) with what to compute on a prompt's layers (`compute`) and which layers (`plan`), then sends plain
vLLM requests, a whole batch per `generate` call, tagged for it (`forward`). The static recorder (static.py) taps
those layers' attention kernels, on an engine with static points or without (`static.recorder`); the kernel runs at
vLLM's attention op, outside the compiled graph, so this works on an engine at vLLM's defaults (compiled, prefix
caching, chunked prefill) as on one built for traces.

At each planned layer's kernel, prompts the step holds whole are reduced there, from the kernel's own arguments,
adjacent prompts of one length in one call (`whole_prompts`, where a tool gives one: head summaries). The reducer
copies the step's rows of its other requests once into each prompt's run of layers, keeping a prompt's chunks
(chunked prefill) until its last, and once a run's last layer holds every position, computes that run: runs are
layers that score alike (`ScoreFunction.layer_groups`), so a short prompt's layers are scored in one call. Only the
results leave the worker (`take`). Under tensor parallelism each rank reduces its own heads where the heads score
independently (the common layout's score function) and the client joins the ranks' heads (`joined`); otherwise every
rank gathers the heads and rank 0 reduces (and copies every prompt). A prompt whose
reduction fails is reported by its reason, never stops the batch.

Requests skip reading vLLM's prefix cache (`skip_reading_prefix_cache`): a reduction sums over every query row, and
the queries of a prefix served from that cache are never computed. They still feed it, as plain requests do.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch

from ..locations.views import gather_heads, tensor_parallel
from ..values import KERNEL_VALUES
from . import static
from .stages import by_stage

#: Tags of reduced requests (the recorder leaves them to the reducer).
TAG = "attnlens-reduce-"
#: Score elements (layers x heads x rows x keys) of one prompt's layers reduced together: short prompts stack many
#: layers into one call (the per-call cost of many small tensors is the cost there), long ones few (measured on the
#: collection benchmark's prompt lengths: 2**22 about 5% faster than 2**21 or 2**20).
GROUP_ELEMENTS = 2**22

#: `compute(attns, layers, tokens, values)` -> {layer: {name: result}}: one prompt's run of layers that score alike,
#: `values` each `[layers, heads, tokens, dim]` (this rank's heads where each rank reduces its own), the queries and
#: keys always among them; results detached on the CPU, heads first (joined across ranks along that axis).
Compute = Callable[[list, list[int], int, dict], dict]
#: `whole_prompts(attn, layer, tokens, values)` -> [{name: result}] per prompt: optional, prompts of one length that
#: the step holds whole, on one layer, `values` each `[prompts, heads, tokens, dim]`: views of vLLM's buffers, not
#: copies (where each rank reduces its own heads).
WholePrompts = Callable[[Any, int, int, dict], list]


def untapped(model, layer: int, shorts=("query", "key")) -> list[str]:
    """Which of the kernel arguments `shorts` vLLM's attention kernel on `layer` does not receive as attnlens serves
    them (no kernel there, latent attention, channels permuted for the rotary kernel, keys shared with an earlier
    layer: `static.taps`): a reduction cannot read those there."""
    taps = static.taps(model.family, model.text_config, layer)
    return [short for short in shorts if taps.get(short) != "kernel"]


class _Prompt:
    """One reduced request: its tokens, its runs of layers reduced together (runs of layers that score alike, split so
    none exceeds `GROUP_ELEMENTS`), each run's rows so far (`[layers in the run, tokens, heads * dim]` per kernel
    argument, allocated when the run's first layer runs) and how many positions each layer has."""

    def __init__(self, tokens: int, groups: list[list[int]], heads: Callable) -> None:
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
    """Installed on the worker's static recorder (`install`): at each planned layer's kernel, it takes the rows of its
    requests (the recorder captures none of them), copies each request's rows into its prompt's run of layers, and
    once a run's last layer holds every position of the prompt, computes the run; results and errors by tag."""

    def __init__(
        self, runner: Any, compute: Compute, plan: dict[int, list[str]], whole_prompts: WholePrompts | None = None
    ) -> None:
        from ..locations import child
        from .blocks import attention_block

        self.runner = runner
        self.recorder = static.recorder(runner)
        self.values = runner.attnlens  # WorkerValues: family, geometry, kernels
        self.compute = compute
        self.whole_prompts = whole_prompts
        # layer -> the standardized values read there (kernel arguments): this pipeline stage's layers of the plan
        self.plan = {layer: reads for layer, reads in plan.items() if layer in self.values.held}
        wanted = {"attention_queries", "attention_keys", *(name for reads in plan.values() for name in reads)}
        self.shorts = [short for name, short in KERNEL_VALUES.items() if name in wanted]
        family = self.values.family
        blocks = child(runner.nnsight_model, family.path("layers", "vllm"))
        self.attn = {layer: attention_block(family, blocks[layer]) for layer in self.plan}
        function = self.values.score_function
        self.groups = function.layer_groups(self.values.config, self.values.geometry.__getitem__, list(self.plan))
        # per layer, each kernel argument's (heads, channels per head): every rank's heads
        self.shapes = {layer: _shapes(self.values.geometry[layer]) for layer in self.plan}
        ranks, rank = tensor_parallel()
        # each rank reduces its own heads where the heads score independently (the common layout's score function
        # on every planned layer); else every rank gathers them and rank 0 reduces
        self.local = ranks == 1 or all(function.layer_key(self.values.config, layer) is not None for layer in self.plan)
        self.here = self.local or rank == 0
        self.prompts: dict[str, _Prompt] = {}
        self.results: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        for layer in self.plan:
            self.recorder.tap(layer)

    def __call__(self, layer: int, query, key, value, spans: list) -> list:
        mine, others = self.recorder.split(spans, TAG)
        if mine and layer in self.plan:
            self._take(layer, (query, key, value), mine)
        return others

    def _take(self, layer: int, arguments: tuple, spans: list) -> None:
        shapes = self.shapes[layer]
        end = max(start + count for _, _, start, count, _ in spans)
        # this step's rows, `[rows, heads * dim]`: this rank's heads, or every rank's where rank 0 reduces (a
        # collective: every rank gathers)
        step = {
            short: self._heads(argument[:end], *shapes[short])
            for short, argument in zip(("query", "key", "value"), arguments)
            if short in self.shorts
        }
        if not self.here:
            return
        if self.whole_prompts is not None and self.local:
            spans = self._reduce_whole_prompts(layer, step, spans)
        for _, request_id, start, count, position in spans:
            tag = self.recorder.tags[request_id]
            if tag in self.errors:
                continue
            try:
                rows = {short: tensor[start : start + count] for short, tensor in step.items()}
                self._copy(tag, request_id, layer, rows, position)
            except Exception as error:  # noqa: BLE001  one prompt's failure is reported, the batch goes on
                self.errors[tag] = f"{type(error).__name__}: {' '.join(str(error).split())}"
                self.results.pop(tag, None)
                self.prompts.pop(tag, None)

    def _reduce_whole_prompts(self, layer: int, step: dict, spans: list) -> list:
        """Reduce, straight from this step's rows, the prompts the step holds whole (no copy into a run: on 8 x 101
        tokens of SmolLM2 the copies were 15 to 25 ms a call), adjacent prompts of one length together; returns the
        spans left to copy (chunks of a prompt split over steps)."""
        group: list = []
        whole = sorted(
            (
                span
                for span in spans
                if not span[4]
                and span[3] == self.runner.requests[span[1]].num_prompt_tokens
                and self.recorder.tags[span[1]] not in self.errors
            ),
            key=lambda span: span[2],
        )
        for span in whole:
            if group and (span[3] != group[0][3] or span[2] != group[-1][2] + group[-1][3]):
                self._reduce_group(layer, step, group)
                group = []
            group.append(span)
        if group:
            self._reduce_group(layer, step, group)
        taken = {span[1] for span in whole}
        return [span for span in spans if span[1] not in taken]

    def _reduce_group(self, layer: int, step: dict, group: list) -> None:
        tags = [self.recorder.tags[request_id] for _, request_id, _, _, _ in group]
        start, tokens = group[0][2], group[0][3]
        shapes = self.shapes[layer]
        rows = {
            short: flat[start : start + len(group) * tokens]
            .view(len(group), tokens, -1, shapes[short][1])
            .transpose(1, 2)
            for short, flat in step.items()
        }
        values = {name: rows[short] for name, short in KERNEL_VALUES.items() if short in rows}
        for tag in tags:  # a preempted prompt computed afresh: its earlier record goes (its results are replaced)
            self.prompts.pop(tag, None)
        try:
            found = self.whole_prompts(self.attn[layer], layer, tokens, values)
        except Exception as error:  # noqa: BLE001  these prompts' failure is reported, the batch goes on
            for tag in tags:
                self.errors[tag] = f"{type(error).__name__}: {' '.join(str(error).split())}"
            return
        for tag, result in zip(tags, found):
            if tag not in self.errors:
                self.results.setdefault(tag, {})[layer] = result

    def _heads(self, flat: torch.Tensor, total: int, dim: int) -> torch.Tensor:
        flat = flat.reshape(flat.shape[0], -1)
        return flat if self.local else gather_heads(flat.unflatten(1, (-1, dim)), total, 1).flatten(1)

    def _copy(self, tag: str, request_id: str, layer: int, rows: dict, position: int) -> None:
        """One request's rows of this step on `layer` into its prompt's run; the run reduced once complete."""
        prompt = self.prompts.get(tag)
        if prompt is None or (not position and layer in prompt.filled):  # new, or preempted and computed afresh
            tokens = self.runner.requests[request_id].num_prompt_tokens
            prompt = self.prompts[tag] = _Prompt(tokens, self.groups, self.values.geometry.__getitem__)
            self.results.pop(tag, None)
        if prompt.filled.get(layer, 0) != position:  # the rows before were never computed here
            raise RuntimeError(
                f"layer {layer}'s rows before position {position} were never computed here (served from vLLM's "
                f"prefix cache?); reduced requests skip reading it"
            )
        run = prompt.run_of[layer]
        held = prompt.rows.get(run[0])
        if held is None:
            held = prompt.rows[run[0]] = {
                short: tensor.new_empty(len(run), prompt.tokens, tensor.shape[1]) for short, tensor in rows.items()
            }
        count = rows["query"].shape[0]
        for short, tensor in rows.items():
            held[short][run.index(layer), position : position + count] = tensor
        prompt.filled[layer] = position + count
        if layer == run[-1] and prompt.filled[layer] == prompt.tokens:
            self._reduce(tag, prompt.tokens, run, prompt.rows.pop(run[0]))

    def _reduce(self, tag: str, tokens: int, layers: list[int], held: dict) -> None:
        shapes = self.shapes[layers[0]]
        stacked = {short: rows.unflatten(2, (-1, shapes[short][1])).transpose(1, 2) for short, rows in held.items()}
        values = {name: stacked[short] for name, short in KERNEL_VALUES.items() if short in stacked}
        found = self.compute([self.attn[layer] for layer in layers], layers, tokens, values)
        self.results.setdefault(tag, {}).update(found)

    def pop(self, tag: str) -> dict | str:
        self.prompts.pop(tag, None)
        if tag in self.errors:
            return self.errors.pop(tag)
        found = self.results.pop(tag, {})
        if set(found) != set(self.plan):
            return f"RuntimeError: reduced on layers {sorted(found)} of {sorted(self.plan)}"
        return found


def _shapes(heads) -> dict[str, tuple[int, int]]:
    """Each kernel argument's (heads, channels per head) on a layer of these `heads` (its `Geometry`)."""
    return {
        "query": (heads.num_heads, heads.qk_head_dim),
        "key": (heads.num_kv_heads, heads.qk_head_dim),
        "value": (heads.num_kv_heads, heads.head_dim),
    }


def install(worker: Any, compute: bytes, plan: dict) -> None:
    """Run in each worker (`collective_rpc`): reduce tagged requests with `compute` on `plan`'s layers from now on.
    `compute` comes cloudpickled (`pickled`: a `Compute`, or a (`Compute`, `WholePrompts`) pair): vLLM's executors
    pickle arguments plainly, which refuses a lambda."""
    import cloudpickle

    runner = worker.model_runner
    found = cloudpickle.loads(compute)
    compute, whole_prompts = found if isinstance(found, tuple) else (found, None)
    static.recorder(runner).reduce = Reducer(runner, compute, plan, whole_prompts)


def pickled(compute: Compute, whole_prompts: WholePrompts | None = None) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(compute if whole_prompts is None else (compute, whole_prompts))


def take(worker: Any, tags: list[str]) -> dict:
    """Run in each worker (`collective_rpc`): per tag, its {layer: {name: result}} (this rank's heads, or every
    rank's) or the reason it failed (empty on a rank that reduces nothing); the requests' records freed."""
    recorder = worker.model_runner.attnlens_static
    recorder.take([tag for tag in tags if tag in recorder.requests])
    return {tag: recorder.reduce.pop(tag) for tag in tags} if recorder.reduce.here else {}


def joined(per_rank: list[dict], tag: str, stages: int = 1) -> dict | str:
    """One prompt's results from every rank that reduced (in vLLM's rank order: pipeline stage by stage, each stage's
    tensor-parallel ranks in turn): within a stage each rank's heads joined along the head axis, then every stage's
    layers together; or the first reason where a rank failed."""
    whole: dict = {}
    for ranks in by_stage(per_rank, stages):
        found = [taken[tag] for taken in ranks if taken]
        failed = [result for result in found if isinstance(result, str)]
        if failed:
            return failed[0]
        whole.update(
            {
                layer: {name: _join([result[layer][name] for result in found]) for name in results}
                for layer, results in found[0].items()
            }
        )
    return whole


def _join(parts: list):
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return [per_head for part in parts for per_head in part]  # a list per head


def forward(model, prompts: list[list[int]]) -> list[dict | str]:
    """Each prompt's {layer: {name: result}} from the installed reducer, or the reason it failed: one plain request
    each, all in one `generate` call."""
    from vllm import SamplingParams

    engine = model.vllm_entrypoint
    tags = [f"{TAG}{uuid.uuid4().hex}" for _ in prompts]
    params = [
        SamplingParams(
            max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True, extra_args={static.CONFIG_KEY: tag}
        )
        for tag in tags
    ]
    try:
        engine.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    finally:  # what a failed call left in the worker is freed too
        per_rank = engine.collective_rpc(take, args=(tags,))
    return [joined(per_rank, tag, model.stages) for tag in tags]


def reduce(
    model,
    compute: Compute,
    plan: dict[int, list[str]],
    prompts: list[list[int]],
    whole_prompts: WholePrompts | None = None,
) -> list[dict | str]:
    """Install `compute` (and `whole_prompts`) on `plan` in every worker, then `forward` the prompts."""
    model.vllm_entrypoint.collective_rpc(install, args=(pickled(compute, whole_prompts), plan))
    return forward(model, prompts)
