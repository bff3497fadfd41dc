"""The server's side in vLLM's worker: the rows of requests that ask for attention, reduced at every step.

`attnlens serve` builds vLLM's engine with `additional_config["attnlens_serve"]`; the worker then installs `Rows` on
its static recorder (static.py), which taps every layer whose attention kernel receives the queries and keys as
attnlens serves them. A request asks through its sampling parameters' `extra_args` (the OpenAI server's `vllm_xargs`):
`KEY` holds its plan (`plan_of`: features, layers, heads, rows, spans, top_k), `static.CONFIG_KEY` a tag. At each
tapped layer's kernel, the step's rows that the plan wants are scored against the request's keys with the family's
score function. A decode step's row (one per request) is scored by `kernels.paged_rows` with its keys read in place
from vLLM's paged cache, every request's at once, and kept until the step is over, when every layer's rows of the
requests that asked alike are reduced in one call (`_Step`); a prompt's rows (many per request) are scored against
keys copied out of the cache and reduced at the layer. The features are `attnlens.row_features`'. Only the numbers
stay, per request and step, until the API server takes them (`take`, through `collective_rpc`). Requests without a
plan take vLLM's path untouched.

Rows: "prompt" (every prompt position), "generated" (the row that produced each generated token: the prompt's last,
then each decode step's), or "all". Under tensor parallelism each rank scores decode rows on its own heads and the
rows are gathered; a prompt's queries and keys are gathered; rank 0 reduces.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from .. import kernels, row_features
from ..locations.views import gather_heads, gathered_heads, heads_first, local_heads, tensor_parallel
from . import kept, static
from .stages import by_stage

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
    """One request's plan and its steps not yet taken: each a `_Step` and the request's rows in it."""

    def __init__(self, tag: str, asked: str, prompt_tokens: int) -> None:
        self.tag, self.asked, self.prompt_tokens = tag, asked, prompt_tokens
        self.plan = plan_of(asked)
        self.layers = set(self.plan["layers"])
        self.steps: list[tuple[_Step, slice]] = []
        self.finished: float | None = None

    def wanted(self, position: int, count: int) -> range:
        """The positions of a step's rows (`position` .. + `count`) that the plan reduces."""
        first = self.prompt_tokens - 1 if self.plan["rows"] == "generated" else 0
        last = self.prompt_tokens if self.plan["rows"] == "prompt" else position + count
        return range(max(position, first), min(position + count, last))

    def taken(self) -> dict:
        """The numbers so far, each array `[layers, heads, rows, ...]` over its steps' rows (a pattern's keys padded
        to its widest row), as `wire` sends them; held no longer here."""
        for step, _ in self.steps:
            step.arrays()
        failed = [step.error for step, _ in self.steps if step.error]
        if failed:
            self.steps = []
            empty = torch.zeros(0, dtype=torch.long)
            return {"positions": wire(empty), "arrays": {}, "error": f"these rows were not reduced ({failed[0]})"}
        positions = torch.cat([step.positions[rows] for step, rows in self.steps])
        width = int(positions.max()) + 1  # a pattern's keys: up to these rows' last
        parts: dict[str, list[torch.Tensor]] = {}
        for step, rows in self.steps:
            for name, array in step.arrays().items():
                part = array[:, :, rows]
                if name == "pattern":
                    part = torch.nn.functional.pad(part[..., :width], (0, max(width - part.shape[-1], 0)))
                parts.setdefault(name, []).append(part)
        self.steps = []
        return {"positions": wire(positions), "arrays": {name: wire(torch.cat(p, dim=2)) for name, p in parts.items()}}


class _Step:
    """The rows one step reduced for requests that asked alike (one plan), in the requests' order: their positions
    and, per layer, either their pattern (decode rows, one per request: reduced for every layer at once when the step
    is over, `arrays`) or their features (a prompt's rows, reduced at the layer: they may be many)."""

    def __init__(self, served: list[_Served], positions: torch.Tensor, counts: list[int], request_ids=()) -> None:
        self.plan, self.request_ids = served[0].plan, list(request_ids)
        self.positions = positions
        self.width = int(positions.max()) + 1  # keys up to the last row's (batches of other rows may be wider)
        self.prompt_tokens = torch.tensor([one.prompt_tokens for one in served]).repeat_interleave(torch.tensor(counts))
        self.patterns: dict[int, torch.Tensor] = {}  # layer -> [heads, rows, keys], key 0 first
        self.found: dict[int, dict[str, torch.Tensor]] = {}  # layer -> features [heads, rows, ...]
        self._arrays: dict[str, torch.Tensor] | None = None
        self.error: str | None = None
        start = 0
        for one, count in zip(served, counts):
            one.steps.append((self, slice(start, start + count)))
            start += count

    def arrays(self) -> dict[str, torch.Tensor]:
        """The features, `[layers, heads, rows, ...]` in the plan's order of layers; the patterns then dropped. A
        failure is the step's `error` (its requests' responses say why they have no numbers), never the engine's."""
        if self._arrays is None:
            try:
                self._arrays = self._reduced()
            except Exception as error:  # noqa: BLE001  the server goes on; the client reads why
                self.error = f"{type(error).__name__}: {error}"
                self._arrays = {}
            self.patterns, self.found = {}, {}
        return self._arrays

    def _reduced(self) -> dict[str, torch.Tensor]:
        plan = self.plan
        layers = [layer for layer in plan["layers"] if layer in (self.patterns or self.found)]  # this stage's
        if self.patterns:
            stacked = torch.stack([self.patterns[layer] for layer in layers])
            request = row_features.Rows(self.positions, self.prompt_tokens, plan["spans"], plan["top_k"])
            found = row_features.compute(plan["features"], stacked.flatten(0, 1), request)
            return {name: array.unflatten(0, stacked.shape[:2]) for name, array in found.items()}
        names = self.found[layers[0]]
        return {name: _stacked([self.found[layer][name] for layer in layers]) for name in names}

    def bytes(self) -> int:
        arrays = [*self.patterns.values(), *(a for f in self.found.values() for a in f.values())]
        arrays += list((self._arrays or {}).values())
        return sum(a.numel() * a.element_size() for a in arrays)


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer arrays stacked on a new first axis; patterns' keys padded to the widest layer's."""
    if parts[0].dim() == 3:
        width = max(part.shape[-1] for part in parts)
        parts = [torch.nn.functional.pad(part, (0, width - part.shape[-1])) for part in parts]
    return torch.stack(parts)


class _Now:
    """The step in progress, worked out at its first tapped layer: the recorder's spans (a new list each step), the
    served requests' spans with rows their plans want and the other requests', the decode batch of each KV cache group,
    and the `_Step`s (a plan's decode rows by its plan, a request's prompt rows by the request)."""

    def __init__(self, spans: list | None = None, mine: list | tuple = (), others: list | tuple = ()) -> None:
        self.spans, self.mine, self.others = spans, list(mine), list(others)
        self.batches: dict[int, _Decoding] = {}
        self.steps: dict[str | int, _Step] = {}


class _Decoding:
    """A step's decode rows (one per request) of the requests one KV cache group holds, worked out at the first layer
    that reduces them and kept for the step's other layers: where each row is in the step's tokens, its position, its
    block table row, and for each plan's `_Step` (one per step, whatever group its layers are in) the rows of this
    batch in that step's order."""

    def __init__(self, rows: Rows, kernel, spans: list) -> None:
        self.request_ids = [span[1] for span in spans]
        self.starts = torch.tensor([span[2] for span in spans])
        self.positions = torch.tensor([span[4] for span in spans])
        self.tables, self.block_size = rows.values.tables.rows(kernel, self.request_ids)
        self.steps: list[tuple[_Step, torch.Tensor]] = []
        if rows.here:
            groups: dict[str, list[str]] = {}
            for request_id in self.request_ids:
                groups.setdefault(rows.served[request_id].asked, []).append(request_id)
            order = {request_id: i for i, request_id in enumerate(self.request_ids)}
            for asked, request_ids in groups.items():
                step = rows.now.steps.get(asked)
                if step is None:
                    served = [rows.served[request_id] for request_id in request_ids]
                    index = torch.tensor([order[request_id] for request_id in request_ids])
                    step = _Step(served, self.positions[index], [1] * len(served), request_ids)
                    rows.now.steps[asked] = step
                self.steps.append((step, torch.tensor([order[request_id] for request_id in step.request_ids])))


def wire(array: torch.Tensor) -> tuple[str, list[int], bytes]:
    """An array as vLLM's RPC carries it intact (its serializer turns tensors inside a result into lists): dtype,
    shape and bytes (`unwire`)."""
    return str(array.dtype).removeprefix("torch."), list(array.shape), array.contiguous().numpy().tobytes()


def joined(per_rank: list[dict], stages: int) -> dict:
    """The numbers the ranks took (`Rows.take`, in vLLM's rank order), by vLLM's request id: each pipeline stage's
    (from its rank that reduces) joined along the layer axis, stage after stage (a stage holds a run of layers, and a
    plan's layers are sorted); the first stage's error where one failed."""
    found: dict = {}
    for ranks in by_stage(per_rank, stages):
        for request_id, numbers in next((taken for taken in ranks if taken), {}).items():
            whole = found.setdefault(request_id, numbers)
            if whole is numbers:
                continue
            if numbers.get("error") and not whole.get("error"):
                whole["error"] = numbers["error"]
            for name, (dtype, shape, data) in numbers["arrays"].items():  # C order: the first axis's bytes follow
                _, before, held = whole["arrays"].get(name, (dtype, [0, *shape[1:]], b""))
                whole["arrays"][name] = (dtype, [before[0] + shape[0], *shape[1:]], held + data)
    for numbers in found.values():
        if numbers.get("error"):  # no stage's layers without the others'
            numbers["arrays"] = {}
    return found


def unwire(sent: tuple) -> torch.Tensor:
    dtype, shape, data = sent
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


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
        # this pipeline stage's (every layer without pipeline parallelism): each stage reduces its own
        self.layers = [layer for layer in layers_served(family, config, len(blocks)) if layer in self.values.held]
        self.here = tensor_parallel()[1] == 0
        self.served: dict[str, _Served] = {}  # by vLLM's request id
        #: tags whose numbers were taken for good, and when: their requests (still running if the client left, until
        #: vLLM aborts them) are reduced no more
        self.closed: dict[str, float] = {}
        self.now = _Now()
        self.batching: dict[int, bool] = {}  # layer -> whether `_batched` finds decode rows there
        for layer in self.layers:
            self.recorder.tap(layer)

    def __call__(self, layer: int, query, key, value, spans: list) -> list:
        if self.now.spans is not spans:  # the step's first tapped layer
            self.now = _Now(spans, *self._mine(spans))
        reducing = [span for span in self.now.mine if layer in self.served[span[1]].layers]
        if reducing:
            self._reduce(layer, query, key, reducing)
        return self.now.others

    def _mine(self, spans: list) -> tuple[list, list]:
        """The step's spans of served requests with rows their plans want, and the other requests' spans."""
        tags = self.recorder.tags
        mine, others = self.recorder.split(spans, TAG)
        mine = [span for span in mine if tags[span[1]] not in self.closed]
        for _, request_id, _, _, _ in mine:
            if request_id not in self.served:
                state = self.runner.requests[request_id]
                asked = state.sampling_params.extra_args[KEY]
                self.served[request_id] = _Served(tags[request_id], asked, state.num_prompt_tokens)
        return [span for span in mine if self.served[span[1]].wanted(span[4], span[3])], others

    def _reduce(self, layer: int, query, key, spans: list) -> None:
        """Each request's wanted rows of this step (a suffix of its rows, up to its last wanted one), scored against
        its keys up to there, reduced to its features; decode steps (one row each) of a layer scoring the common
        layout's way scored in one batch, their keys read from the cache blocks in place (`_decoded`)."""
        values = self.values
        heads, function = values.geometry[layer], values.score_function
        batched = self._batched(layer, spans)
        if batched:
            self._decoded(layer, query, key, [span for span in spans if span[1] in batched])
        spans = [span for span in spans if span[1] not in batched]
        if not spans:
            return
        # every rank's heads (collectives: every rank reaches them, for the same spans)
        queries = gathered_heads(query.reshape(query.shape[0], -1), heads.qk_head_dim, heads.num_heads)
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

    def _batched(self, layer: int, spans: list) -> set[str]:
        """The requests whose row `_decoded` reduces: decode steps (one row past the first position), where the
        layer scores the common layout's way on a cache whose blocks are views (`kept.key_chunks`). Which requests
        these are does not depend on the layer (the family and the cache decide), so a request's step is reduced one
        way at every layer."""
        if layer not in self.batching:  # the layer's kind and cache decide, once
            values = self.values
            kernel = values.kernels[layer]
            self.batching[layer] = values.score_function.layer_key(values.config, layer) is not None and (
                kept.key_chunks(kernel, values.tables.rows(kernel, [])[1]) is not None
            )
        if not self.batching[layer]:
            return set()
        return {request_id for _, request_id, _, count, position in spans if count == 1 and position}

    def _decoded(self, layer: int, query, key, spans: list) -> None:
        """Decode steps (one row each) in one batch: each rank's rows from its own heads' queries, its keys read in
        place from the cache blocks (`kernels.paged_rows`), or where that kernel does not apply, every rank's heads
        scored against keys copied out of the blocks, left-padded (`kept.decode_keys`). The rows are kept per plan
        (`_Step.patterns`), reduced when the step is over."""
        values = self.values
        heads, kernel = values.geometry[layer], values.kernels[layer]
        group = values.tables.group(kernel)
        batch = self.now.batches.get(group)
        if batch is None or batch.request_ids != [span[1] for span in spans]:
            batch = self.now.batches[group] = _Decoding(self, kernel, spans)
        local = query.view(query.shape[0], -1, heads.qk_head_dim)[batch.starts]  # [requests, this rank's heads, dim]
        now = key.view(key.shape[0], -1, heads.qk_head_dim)[batch.starts]
        layout = values.score_function.common_layout(heads, values.config, layer)
        sinks = values.sinks.get(layer)
        rows = None
        if layout is not None:
            blocks = kept.key_chunks(kernel, batch.block_size)[0]
            local_sinks = None if sinks is None else local_heads(sinks, heads.num_heads, 0)
            rows = kernels.paged_rows(local, blocks, now, batch.tables, batch.positions, sinks=local_sinks, **layout)
        if rows is not None:
            rows = gather_heads(rows, heads.num_heads, 1)
        else:
            decoding = [
                (table, position, now[i])
                for i, (table, position) in enumerate(zip(batch.tables, batch.positions.tolist()))
            ]
            keys, lengths = kept.decode_keys(kernel, batch.block_size, decoding)
            keys = gather_heads(keys, heads.num_kv_heads, 1)
            queries = gather_heads(local.transpose(0, 1)[None], heads.num_heads, 1)[0].transpose(0, 1)[:, :, None]
            _, (probabilities, _) = static.decode_patterns(values, layer, queries, keys, lengths)
            rows = _from_left(probabilities[:, :, 0], batch.positions)
        if not self.here:
            return
        for step, index in batch.steps:
            step.patterns[layer] = self._heads(rows[index, :, : step.width].transpose(0, 1).float(), step.plan)

    @staticmethod
    def _heads(probabilities: torch.Tensor, plan: dict) -> torch.Tensor:
        return probabilities if plan["heads"] is None else probabilities[plan["heads"]]

    def _record(self, served: _Served, layer: int, probabilities: torch.Tensor, rows: range) -> None:
        """A request's rows `[heads, rows, keys]` on `layer`, reduced to its plan's features and kept."""
        plan, key = served.plan, id(served)
        step = self.now.steps.get(key)
        if step is None:
            step = self.now.steps[key] = _Step([served], torch.arange(rows.start, rows.stop), [len(rows)])
        request = row_features.Rows(step.positions, served.prompt_tokens, plan["spans"], plan["top_k"])
        step.found[layer] = row_features.compute(plan["features"], self._heads(probabilities.float(), plan), request)

    def schedule(self, scheduler_output: Any) -> None:
        """Mark the finished requests; drop the numbers of those not taken within `UNCLAIMED_S` (a rank that reduces
        nothing drops a request once it finishes)."""
        for step in self.now.steps.values():  # the step that ended: its decode rows reduced, every layer at once
            step.arrays()
        self.now = _Now()
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
                if self.here and served.steps:
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
        steps = {id(step): step for served in self.served.values() for step, _ in served.steps}
        return {"requests": len(self.served), "bytes": sum(step.bytes() for step in steps.values())}


def _from_left(probabilities: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows `[requests, heads, longest]` of a left-padded batch (each request's keys at the end) with each request's
    key 0 first, 0 past its position."""
    longest = probabilities.shape[-1]
    columns = (longest - 1 - positions)[:, None] + torch.arange(longest)
    found = probabilities.gather(-1, columns.clamp(max=longest - 1)[:, None].expand_as(probabilities))
    return found.where(torch.arange(longest) <= positions[:, None, None], 0.0)


def install(runner: Any) -> None:
    """Reduce served requests' rows in this worker (an engine that `attnlens serve` built)."""
    static.recorder(runner).reduce = Rows(runner)


def held(worker: Any) -> dict:
    return worker.model_runner.attnlens_static.reduce.held()


def take(worker: Any, tag: str, final: bool) -> dict:
    """Run in each worker (`collective_rpc`): `Rows.take` (empty on a rank that reduces nothing)."""
    return worker.model_runner.attnlens_static.reduce.take(tag, final)
