"""The server's side in vLLM's worker: the rows of requests that ask for attention, reduced at every step.

`attnlens serve` builds vLLM's engine with `additional_config["attnlens_serve"]`; the worker then installs `Rows` on
its static recorder (static.py), which taps every layer whose attention kernel receives the queries and keys as
attnlens serves them. A request asks through its sampling parameters' `extra_args` (the OpenAI server's `vllm_xargs`):
`KEY` holds its plan (`plan_of`: features, layers, heads, rows, spans, top_k), `static.CONFIG_KEY` a tag. At each
tapped layer's kernel, the step's rows that the plan wants are scored against the request's keys (the earlier ones
read from vLLM's paged cache) with the family's score function, as static captures are, reduced by
`attnlens.serve.features` and dropped: only the numbers stay, per request and step, until the API server takes them
(`take`, through `collective_rpc`). Requests without a plan take vLLM's path untouched.

Rows: "prompt" (every prompt position), "generated" (the row that produced each generated token: the prompt's last,
then each decode step's), or "all". Under tensor parallelism every rank gathers the heads and rank 0 reduces.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from .. import row_features
from ..locations.views import gather_heads, gathered_heads, heads_first, tensor_parallel
from . import kept, static

#: `additional_config` key of an engine that serves attention (`attnlens serve`).
CONFIG_KEY = "attnlens_serve"
#: `extra_args` key of a request's plan (JSON: vLLM's `vllm_xargs` carries strings, numbers and lists only).
KEY = "attnlens_attention"
#: Tags of served requests (the static recorder follows tagged requests only).
TAG = "attnlens-serve-"
#: Seconds a finished request's numbers wait to be taken before they are dropped (a client that went away).
UNCLAIMED_S = 300.0


def plan_of(asked: str) -> dict:
    """A request's plan from its `extra_args[KEY]`."""
    plan = json.loads(asked)
    plan["spans"] = tuple(tuple(span) for span in plan.get("spans", ()))
    return plan


def layers_served(family, config, num_layers: int) -> list[int]:
    """The layers whose attention kernel receives the queries and keys as attnlens serves them (`static.taps`):
    where a server reduces rows."""
    return [
        layer
        for layer in range(num_layers)
        if all(static.taps(family, config, layer).get(short) == "kernel" for short in ("query", "key"))
    ]


class _Served:
    """One request's plan and numbers not yet taken: per step with rows, their positions and per layer the arrays."""

    def __init__(self, tag: str, asked: str, prompt_tokens: int) -> None:
        self.tag, self.asked, self.prompt_tokens = tag, asked, prompt_tokens
        self.plan = plan_of(asked)
        self.positions: list[torch.Tensor] = []
        self.arrays: dict[int, list[dict]] = {layer: [] for layer in self.plan["layers"]}
        self.finished: float | None = None

    def wanted(self, position: int, count: int) -> range:
        """The positions of a step's rows (`position` .. + `count`) that the plan reduces."""
        first = self.prompt_tokens - 1 if self.plan["rows"] == "generated" else 0
        last = self.prompt_tokens if self.plan["rows"] == "prompt" else position + count
        return range(max(position, first), min(position + count, last))

    def taken(self) -> dict:
        """The numbers so far, each array's steps joined along the rows (a pattern's keys padded to its widest row),
        as `wire` sends them; held no longer here."""
        positions = torch.cat(self.positions) if self.positions else torch.zeros(0, dtype=torch.long)
        found = {"positions": wire(positions)}
        width = int(positions.max()) + 1 if len(positions) else 0  # a pattern's keys: up to these rows' last
        found["layers"] = {
            layer: {
                name: wire(array[..., :width] if name == "pattern" else array) for name, array in _joined(steps).items()
            }
            for layer, steps in self.arrays.items()
        }
        self.positions = []
        self.arrays = {layer: [] for layer in self.arrays}
        return found


def wire(array: torch.Tensor) -> tuple[str, list[int], bytes]:
    """An array as vLLM's RPC carries it intact (its serializer turns tensors inside a result into lists): dtype,
    shape and bytes (`unwire`)."""
    return str(array.dtype).removeprefix("torch."), list(array.shape), array.contiguous().numpy().tobytes()


def unwire(sent: tuple) -> torch.Tensor:
    dtype, shape, data = sent
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


def _joined(steps: list[dict]) -> dict:
    if not steps:
        return {}
    found = {}
    for name in steps[0]:
        parts = [step[name] for step in steps]
        if name == "pattern":
            width = max(part.shape[-1] for part in parts)
            parts = [torch.nn.functional.pad(part, (0, width - part.shape[-1])) for part in parts]
        found[name] = torch.cat(parts, dim=1)
    return found


class Rows:
    """Installed on the worker's static recorder as its `reduce`: at each tapped layer, the wanted rows of served
    requests reduced to their features; every other request left to vLLM."""

    def __init__(self, runner: Any) -> None:
        from ..locations import child

        self.runner = runner
        self.recorder = static.recorder(runner)
        self.values = runner.attnlens  # WorkerValues: family, config, geometry, kernels
        family, config = self.values.family, self.values.config
        blocks = child(runner.nnsight_model, family.path("layers", "vllm"))
        self.layers = layers_served(family, config, len(blocks))
        self.here = tensor_parallel()[1] == 0
        self.served: dict[str, _Served] = {}  # by vLLM's request id
        #: tags whose numbers were taken for good, and when: their requests (still running if the client left, until
        #: vLLM aborts them) are reduced no more
        self.closed: dict[str, float] = {}
        for layer in self.layers:
            self.recorder.tap(layer)

    def __call__(self, layer: int, query, key, value, spans: list) -> list:
        tags = self.recorder.tags
        mine, others = self.recorder.split(spans, TAG)
        mine = [span for span in mine if tags[span[1]] not in self.closed]
        for _, request_id, _, _, _ in mine:
            if request_id not in self.served:
                state = self.runner.requests[request_id]
                asked = state.sampling_params.extra_args[KEY]
                self.served[request_id] = _Served(tags[request_id], asked, state.num_prompt_tokens)
        reducing = [
            span
            for span in mine
            if layer in self.served[span[1]].arrays and self.served[span[1]].wanted(span[4], span[3])
        ]
        if reducing:
            self._reduce(layer, query, key, reducing)
        return others

    def _reduce(self, layer: int, query, key, spans: list) -> None:
        """Each request's wanted rows of this step (a suffix of its rows, up to its last wanted one), scored against
        its keys up to there, reduced to its features; decode steps (one row each) of a layer scoring the common
        layout's way scored in one batch, their keys read from the cache blocks straight into place (as static
        captures' are: `StaticRecorder._from_cache`)."""
        values = self.values
        heads, function = values.geometry[layer], values.score_function
        # every rank's heads (collectives: every rank reaches them, for the same spans)
        queries = gathered_heads(query.reshape(query.shape[0], -1), heads.qk_head_dim, heads.num_heads)
        batched = self.recorder._from_cache(layer, spans)
        if batched:
            self._decoded(layer, queries, key, [span for span in spans if span[1] in batched])
        spans = [span for span in spans if span[1] not in batched]
        earlier = self.recorder.earlier(layer, spans, values=False)
        for _, request_id, start, count, position in spans:
            served = self.served[request_id]
            rows = served.wanted(position, count)
            now = key[start : start + rows.stop - position]
            flat = now.reshape(now.shape[0], -1)
            if position:
                flat = torch.cat([earlier[request_id][0], flat])
            keys = gather_heads(heads_first(flat, heads.qk_head_dim), heads.num_kv_heads, 1)
            if not self.here:
                continue
            asked = queries[:, :, start + rows.start - position : start + rows.stop - position]
            scores = function.scores(heads, values.config, asked, keys, layer)
            self._record(served, layer, function.softmax(scores, values.sinks.get(layer))[0][0], rows)

    def _decoded(self, layer: int, queries, key, spans: list) -> None:
        """Decode steps (one row each) scored in one batch, their keys left-padded; the requests that asked alike
        (one plan) reduced together too (`row_features.Rows.offsets`), each then keeping its own row."""
        values = self.values
        kernel = values.kernels[layer]
        tables = [values.tables.row(kernel, request_id) for _, request_id, _, _, _ in spans]
        rows = [(table, position, key[start]) for (table, _), (_, _, start, _, position) in zip(tables, spans)]
        keys, lengths = kept.decode_keys(kernel, tables[0][1], rows)
        keys = gather_heads(keys, values.geometry[layer].num_kv_heads, 1)
        if not self.here:
            return
        asked = torch.cat([queries[:, :, start : start + 1] for _, _, start, _, _ in spans])
        _, (probabilities, _) = static.decode_patterns(values, layer, asked, keys, lengths)
        groups: dict[str, list[int]] = {}
        for row, span in enumerate(spans):
            groups.setdefault(self.served[span[1]].asked, []).append(row)
        longest = keys.shape[2]
        for group in groups.values():
            served = [self.served[spans[row][1]] for row in group]
            plan = served[0].plan
            positions = torch.tensor([spans[row][4] for row in group])
            request = row_features.Rows(
                positions,
                torch.tensor([one.prompt_tokens for one in served]),
                plan["spans"],
                plan["top_k"],
                offsets=longest - 1 - positions,
            )
            chosen = probabilities[group, :, 0].transpose(0, 1).float()  # [heads, requests, keys]
            found = row_features.compute(plan["features"], self._heads(chosen, plan), request)
            each = {name: array.split(1, dim=1) for name, array in found.items()}  # one view per request
            first = layer == plan["layers"][0]
            for i, (one, position) in enumerate(zip(served, positions.split(1))):
                if first:
                    one.positions.append(position)
                one.arrays[layer].append({name: views[i] for name, views in each.items()})

    @staticmethod
    def _heads(probabilities: torch.Tensor, plan: dict) -> torch.Tensor:
        return probabilities if plan["heads"] is None else probabilities[plan["heads"]]

    def _record(self, served: _Served, layer: int, probabilities: torch.Tensor, rows: range) -> None:
        """A request's rows `[heads, rows, keys]` on `layer`, reduced to its plan's features and kept."""
        plan = served.plan
        probabilities = self._heads(probabilities.float(), plan)
        positions = torch.arange(rows.start, rows.stop)
        if layer == plan["layers"][0]:
            served.positions.append(positions)
        request = row_features.Rows(positions, served.prompt_tokens, plan["spans"], plan["top_k"])
        served.arrays[layer].append(row_features.compute(plan["features"], probabilities, request))

    def schedule(self, scheduler_output: Any) -> None:
        """Mark the finished requests; drop the numbers of those not taken within `UNCLAIMED_S` (a rank that reduces
        nothing drops a request once it finishes)."""
        now = time.monotonic()
        for request_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            if request_id in self.served:
                self.served[request_id].finished = now
        for request_id, served in list(self.served.items()):
            if served.finished is not None and (not self.here or now - served.finished > UNCLAIMED_S):
                self._forget(request_id)
        for tag, when in list(self.closed.items()):
            if now - when > UNCLAIMED_S:
                del self.closed[tag]

    def take(self, tag: str, final: bool) -> dict:
        """The numbers of `tag`'s requests reduced since the last take, by vLLM's request id (`_Served.taken`); with
        `final` (the API server has their whole response), their records freed."""
        found = {}
        for request_id, served in list(self.served.items()):
            if served.tag == tag:
                if self.here and served.positions:
                    found[request_id] = served.taken()
                if final:
                    self._forget(request_id)
        if final:
            self.recorder.requests.pop(tag, None)
            self.closed[tag] = time.monotonic()
        return found

    def _forget(self, request_id: str) -> None:
        tag = self.served.pop(request_id).tag
        if not any(served.tag == tag for served in self.served.values()):
            self.recorder.requests.pop(tag, None)

    def held(self) -> dict:
        """What this worker holds for served requests (0 and 0 once every response is complete)."""
        arrays = [
            a
            for served in self.served.values()
            for steps in served.arrays.values()
            for step in steps
            for a in step.values()
        ]
        return {"requests": len(self.served), "bytes": sum(a.numel() * a.element_size() for a in arrays)}


def install(runner: Any) -> None:
    """Reduce served requests' rows in this worker (an engine that `attnlens serve` built)."""
    static.recorder(runner).reduce = Rows(runner)


def held(worker: Any) -> dict:
    return worker.model_runner.attnlens_static.reduce.held()


def take(worker: Any, tag: str, final: bool) -> dict:
    """Run in each worker (`collective_rpc`): `Rows.take` (empty on a rank that reduces nothing)."""
    return worker.model_runner.attnlens_static.reduce.take(tag, final)
