"""The static capture backend on vLLM: taps declared when the engine loads, recorded on every request.

`StandardizedVLLM(path, static_points=["attn_probs.10", "value.10"])` checks the points against `support()` before
the engine is built, then vLLM's worker wraps the attention implementation of each tapped layer (which vLLM calls
from its attention op, outside the compiled graph, so taps run under vLLM's compiled model) and, for head outputs,
puts a forward pre-hook on the output projection (inside the graph: those need the eager engine, `needs_eager`). No
trace is shipped with a request and nnsight's interleaver has nothing to run, so requests take vLLM's ordinary path.
`model.static_generate(prompts, ...)` runs plain vLLM requests and returns each one's output with its captures, one
`Cache` per step (step 0 the prefill or its first chunk, then one per decode step) and each step's first position,
in the layouts `run_with_cache` gives (batch axis of one, as a traced invoke on vLLM gives).

Scores and probabilities are rebuilt at the hook with the family's score function, from the kernel's queries and the
request's keys, the earlier ones read from vLLM's paged KV cache (prefix-cached ones included), as traced requests
read them. Keys and values on a decode step span the whole context, as on the traced path. A request's captures are
held in the worker from its first step until they are taken.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import points as plan
from ..errors import Unavailable
from ..locations import Derived, Location, child
from ..locations.views import gather_heads, gathered_heads, heads_first, tensor_parallel
from ..locations.vllm import KernelInput, RebuiltPattern
from ..names import Cache
from ..values import BY_NAME, BY_SHORT, of_scope
from . import kept, media
from .blocks import attention_block, handoffs
from .stages import by_stage

#: Rebuilt names -> the taps they are rebuilt from.
SOURCES = dict.fromkeys(("attn_scores", "attn_probs", "attn_sinks"), ("query", "key"))
CONFIG_KEY = "attnlens_static"


def taps(family, config, layer: int) -> dict[str, str]:
    """Cache name -> "kernel" or "projection": what a static tap can hold on `layer`, and the module whose forward
    pre-hook records it (the attention kernel, or the output projection), from the family's vLLM locations."""
    if handoffs(family, config, layer)[0] is None:
        return {}  # no attention kernel (a linear-attention layer): no heads to split or gather
    locations = family.locations_for(config, layer, "vllm")
    premix = locations.get("attention_premix")
    found = {}
    for name, location in locations.items():
        if isinstance(location, (KernelInput, RebuiltPattern)) and getattr(location, "static_tap", True):
            found[BY_NAME[name].short] = "kernel"
        elif (
            premix is not None and name in ("attention_head_outputs", "attention_premix") and location.key == premix.key
        ):
            found[BY_NAME[name].short] = "projection"
    if any(found.get(short) != "kernel" for source in SOURCES.values() for short in source):
        for rebuilt in SOURCES:  # rebuilt from the kernel's queries and keys, which it does not receive as served
            found.pop(rebuilt, None)
    return found


#: Why a compiled engine serves a value to no trace: only the attention op runs outside vLLM's compiled graph.
ON_THE_EAGER_ENGINE = (
    "this engine runs vLLM's compiled model (static_points without enforce_eager), where only the attention op's "
    "values reach a trace; build StandardizedVLLM(..., enforce_eager=True) to read this value"
)
#: Why a compiled engine's trace cannot edit a rebuilt pattern.
NO_PATTERN_EDITS = (
    "this engine runs vLLM's compiled model, where an edited pattern's head outputs cannot be recomputed (that "
    "happens at the output projection's input, inside the compiled graph); edit the queries or keys, or build "
    "StandardizedVLLM(..., enforce_eager=True)"
)


class CompiledMode:
    """What a trace reads on an engine running vLLM's compiled model (`Access.mode`): the values handed off at the
    attention kernel (`taps`' "kernel" ones: the worker hands them to nnsight where vLLM runs the op,
    `worker.hand_off_at_kernel`), the rebuilt pattern read-only. A pipelined engine serves the same values, to static
    taps and the tools reducing in the worker only, and every other value for `why` (`stages.NO_TRACES`)."""

    def __init__(self, family, config, why: str = ON_THE_EAGER_ENGINE) -> None:
        self.family, self.config, self.why = family, config, why

    def reasons(self, layer: int | None) -> dict[str, str]:
        if layer is None:
            return dict.fromkeys(of_scope("model"), self.why)
        taps_here = taps(self.family, self.config, layer)
        served = {BY_SHORT[short].name for short, where in taps_here.items() if where == "kernel"}
        return {name: self.why for name in of_scope("layer", "attention", "mlp") if name not in served}

    def location(self, location: Location) -> Location:
        if isinstance(location, RebuiltPattern) and location.writable:
            why_not = NO_PATTERN_EDITS if self.why == ON_THE_EAGER_ENGINE else self.why  # pipelined: no edits at all
            return Derived(location, _same, in_place=False, note=location.note, why_not=why_not)
        return location


def _same(envoy: Any, value: Any) -> Any:
    return value


def needs_eager(model: Any, keys: list[str]) -> list[str]:
    """The declared cache keys whose tap is a module inside vLLM's compiled graph (the output projection's input):
    under the compiled model no hook there runs, so they need the eager engine (`model.engine_mode`)."""
    found = []
    for key in keys:
        short, _, layer = key.rpartition(".")
        if taps(model.family, model.text_config, int(layer)).get(short) == "projection":
            found.append(key)
    return found


def declare(model: Any, names: Any) -> list[str]:
    """Check `names` (cache names, e.g. "attn_probs.10" or "attention_values.10") before the engine loads.

    Unknown names raise `KeyError`, values the family or vLLM cannot serve raise `attnlens.Unavailable` with
    `support()`'s reason, and values the static backend does not tap raise `Unavailable` naming the ones it does.
    Returns the declared cache keys, in forward order. `names` may be a function of the model (its family and config
    known, its engine not yet built) that returns them (`attnlens.collect` declares every layer's taps so)."""
    names = names(model) if callable(names) else names
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError("static_points is empty: name at least one tap, e.g. 'attn_probs.0'")
    points = plan.points(model, names)
    for short, layer in points:
        allowed = {} if layer is None else taps(model.family, model.text_config, layer)
        if layer is not None and not allowed:
            raise Unavailable(
                f"{short}.{layer} on {model.family.name}: layer {layer} has no attention kernel on vLLM, "
                f"so no static taps; read its values with a trace"
            )
        if short not in allowed:
            raise Unavailable(
                f"{short if layer is None else f'{short}.{layer}'} on {model.family.name}: not a static tap on vLLM; "
                f"static taps are {', '.join(allowed or taps(model.family, model.text_config, 0))} (per layer); "
                f"read other values with a trace"
            )
    return [f"{short}.{layer}" for short, layer in points]


def _before_forward(module: torch.nn.Module, hook: Any) -> None:
    """Run `hook(module, args, kwargs)` before each run of `module.forward`, however it is called: vLLM's Transformers
    backend calls its kernel's `forward` directly, which skips forward pre-hooks."""
    forward = module.forward

    def run(*args, **kwargs):
        hook(module, args, kwargs)
        return forward(*args, **kwargs)

    module.forward = run


@dataclass
class StaticResult:
    """One request: vLLM's `RequestOutput` and its captures, one `Cache` per step (0: the prefill, or its first chunk),
    and each step's first position: step 0 starts past any prefix vLLM served from its prefix cache (those positions'
    keys are in the captured keys and patterns, but their queries were never computed, so they have no rows)."""

    output: Any
    steps: list[Cache]
    positions: list[int]

    def attention(self, layer: int, step: int | None = None) -> dict[str, torch.Tensor]:
        """`capture_attention`'s dict for `layer` ("scores", "probs", "value", as declared; no batch axis): one step,
        or with `step=None` the prefill and every decode step's rows joined along the query axis (the values of
        the whole context, keys as long as the last step's)."""
        steps = self.steps if step is None else [self.steps[step]]
        found = {}
        for kind, short in (("scores", "attn_scores"), ("probs", "attn_probs")):
            key = f"{short}.{layer}"
            if key in steps[-1]:
                width = steps[-1][key].shape[-1]
                fill = 0.0 if kind == "probs" else torch.finfo(steps[-1][key].dtype).min
                rows = [torch.nn.functional.pad(c[key][0], (0, width - c[key].shape[-1]), value=fill) for c in steps]
                found[kind] = torch.cat(rows, dim=1)
        if f"value.{layer}" in steps[-1]:
            found["value"] = steps[-1][f"value.{layer}"][0].transpose(0, 1)
        return found


# --- the worker's side ---------------------------------------------------------------------------------------------


class _Request:
    """One request's captures in the worker: per step, its first position and that step's captures, in their
    layouts (gathered across ranks, but for the patterns each rank scores on its own heads: `StaticRecorder.ranked`)."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.steps: list[dict[str, torch.Tensor]] = []


def before_kernel(kernel: torch.nn.Module, hook: Any) -> None:
    """Run `hook(query, key, value)` before each run of the kernel's attention implementation; where it returns
    `(query, key, value)`, the kernel runs on those. vLLM calls it from its attention op, which runs outside the
    compiled graph (and whatever path the model code takes to the kernel), so the hook runs under vLLM's compiled
    model as under the eager one."""
    impl = kernel.impl
    forward = impl.forward

    def run(layer, query, key, value, *args, **kwargs):
        replaced = hook(query, key, value)
        if replaced is not None:
            query, key, value = replaced
        return forward(layer, query, key, value, *args, **kwargs)

    impl.forward = run


class StaticRecorder:
    """Installed in vLLM's worker when the engine declares static points: it runs at the tapped layers' attention
    ops (and, for head outputs, before their output projections)."""

    def __init__(self, runner: Any, keys: list[str]) -> None:
        self.runner = runner
        self.values = runner.attnlens  # WorkerValues: family, geometry, kernels, block tables
        self.keys = keys
        self.layers: dict[int, set[str]] = {}
        for key in keys:
            short, _, layer = key.rpartition(".")
            self.layers.setdefault(int(layer), set()).add(short)
        self.requests: dict[str, _Request] = {}  # by tag (or vLLM's request id)
        self.tags: dict[str, str] = {}  # vLLM's request id -> tag
        self.tokens: dict[str, int] = {}
        self.spans: list[tuple[_Request, str, int, int, int]] | None = []
        #: `reduce(layer, query, key, value, spans)` -> the spans it leaves to be captured: called at each tapped
        #: layer's kernel with its arguments and this step's `_spans()`; a tool installs one (through
        #: `collective_rpc`) to reduce its own requests' rows in the worker (`attnlens.collect`).
        self.reduce: Any = None
        self.tapped: set[int] = set()  # layers whose kernel runs `_kernel_hook`
        #: the cache keys this rank holds only its own heads of (patterns it scores on its own heads): joined across
        #: ranks by the client when taken (`joined`), so no step waits on a collective for them
        self.ranked: set[str] = set()
        family, config = self.values.family, self.values.config
        layers = child(runner.nnsight_model, family.path("layers", "vllm"))
        for layer, shorts in self.layers.items():
            if layer not in self.values.held:
                continue  # another pipeline stage's block: that stage records it (`joined`)
            where = taps(family, config, layer)
            _, projection = handoffs(family, config, layer)
            if any(where.get(short) == "kernel" for short in shorts):
                self.tap(layer)
            if any(where.get(short) == "projection" for short in shorts):
                attention = attention_block(family, layers[layer])
                _before_forward(child(attention, projection)._module, self._projection_hook(layer))

    def tap(self, layer: int) -> None:
        """Run `_kernel_hook` at `layer`'s attention kernel from now on (once): for its static points, and for what
        `reduce` takes there (a tool may tap a layer the engine declared no static point on)."""
        if layer in self.tapped:
            return
        family, config = self.values.family, self.values.config
        kernel, _ = handoffs(family, config, layer)
        if kernel is None:
            raise Unavailable(f"layer {layer} of this {family.name} model has no attention kernel on vLLM to tap")
        attention = attention_block(family, child(self.runner.nnsight_model, family.path("layers", "vllm"))[layer])
        self.layers.setdefault(layer, set())
        before_kernel(child(attention, kernel)._module, self._kernel_hook(layer))
        self.tapped.add(layer)

    def split(self, spans: list, prefix: str) -> tuple[list, list]:
        """This step's spans (`_spans`) of requests tagged with `prefix` (a tool's own), and the others."""
        mine, others = [], []
        for span in spans:
            (mine if self.tags.get(span[1], "").startswith(prefix) else others).append(span)
        return mine, others

    # --- scheduling ----------------------------------------------------------------------------------------

    def schedule(self, scheduler_output: Any) -> None:
        for data in scheduler_output.scheduled_new_reqs:
            extra = getattr(data.sampling_params, "extra_args", None) or {}
            if not self.keys and CONFIG_KEY not in extra:
                continue  # taps a tool added on an engine without static points follow its own requests only
            if extra.get("attnlens"):
                continue  # a trace's request: the trace reads what it wants
            tag = extra.get(CONFIG_KEY) or data.req_id
            self.tags[data.req_id] = tag
            self.requests.setdefault(tag, _Request())
        for request_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            self.tags.pop(request_id, None)  # its captures stay until taken
        if hasattr(self.reduce, "schedule"):
            self.reduce.schedule(scheduler_output)
        self.tokens = dict(scheduler_output.num_scheduled_tokens)
        self.spans = None  # worked out at the first hook, when the batch's order is final

    def _spans(self) -> list[tuple[_Request, str, int, int, int]]:
        """(request, vLLM's id, first row in the batch, rows, first position) of each captured request this step."""
        if self.spans is None:
            self.spans, start = [], 0
            for request_id in self.runner.input_batch.req_ids:
                count = self.tokens.get(request_id)
                if count is None:
                    continue
                request = self.requests.get(self.tags.get(request_id, ""))
                if request is not None:
                    position = self.runner.requests[request_id].num_computed_tokens
                    request.positions.append(position)
                    request.steps.append({})
                    self.spans.append((request, request_id, start, count, position))
                start += count
        return self.spans

    # --- hooks: each step's captures, in their layouts -------------------------------------------------------

    def _kernel_hook(self, layer: int):
        shorts = self.layers[layer]
        values = self.values
        heads = values.geometry[layer]
        dims = {"key": heads.qk_head_dim, "value": heads.head_dim}
        pattern = shorts & set(SOURCES)
        context = shorts & {"key", "value"} or pattern
        with_values = "value" in shorts  # a pattern needs only the keys
        # under tensor parallelism each rank scores its own heads and keeps their pattern (`ranked`: the client joins
        # the ranks' heads), where heads score independently (the common layout's score function, no sink logits):
        # no rank scores every head, and the queries are not gathered for it
        own = (
            tensor_parallel()[0] > 1
            and values.score_function.layer_key(values.config, layer) is not None
            and layer not in values.sinks
        )
        with_queries = "query" in shorts or (bool(pattern) and not own)
        if own:
            self.ranked |= {f"{short}.{layer}" for short in pattern}

        def hook(query, key, value):
            spans = self._spans()
            if self.reduce is not None:  # a tool takes its requests' rows here (it leaves the others to the capture)
                spans = self.reduce(layer, query, key, value, spans)
            if not shorts:  # tapped for the tool only
                return
            direct = self._from_cache(layer, spans) if pattern and not shorts & {"key", "value"} else set()
            earlier = self.earlier(layer, [s for s in spans if s[1] not in direct], with_values) if context else {}
            scored = []  # (the step's captures, queries, keys) of each request, for its pattern
            decoding = []  # (the step's captures, queries, vLLM's id, position, key row) of `direct`'s requests
            flat_query, every, scoring = query.reshape(query.shape[0], -1), None, None
            if spans and with_queries:  # every rank's heads of the step's queries: one collective, not one per request
                every = gathered_heads(flat_query, heads.qk_head_dim, heads.num_heads)
            if pattern:
                scoring = heads_first(flat_query, heads.qk_head_dim) if own else every
            for request, request_id, start, count, position in spans:
                step = request.steps[-1]
                rows = slice(start, start + count)
                if "query" in shorts:
                    step[f"query.{layer}"] = every[:, :, rows].clone()
                if not context:
                    continue
                queries = None if scoring is None else scoring[:, :, rows]
                if request_id in direct:
                    decoding.append((step, queries, request_id, position, key[rows]))
                    continue
                flat = [key[rows].reshape(count, -1)] + ([value[rows].reshape(count, -1)] if with_values else [])
                if position:
                    flat = [torch.cat([before, now]) for before, now in zip(earlier[request_id], flat)]
                for short, x in zip(("key", "value"), flat):
                    if short in shorts:
                        tensor = gathered_heads(x, dims[short], heads.num_kv_heads)
                        step[f"{short}.{layer}"] = tensor if position else tensor.clone()
                if pattern:
                    keys = heads_first(flat[0], dims["key"])
                    scored.append((step, queries, keys if own else gather_heads(keys, heads.num_kv_heads, 1)))
            if scored:
                self._patterns(layer, pattern, scored)
            if decoding:
                self._decoded(layer, pattern, decoding, own)

        return hook

    def _from_cache(self, layer: int, spans: list) -> set[str]:
        """The requests of this step whose pattern `_decoded` scores straight from the cache's blocks: decode steps
        (one query past the first position), two or more, of a layer scoring the common layout's way, on a cache
        whose blocks are views (`kept.key_chunks`)."""
        decoding = {request_id for _, request_id, _, count, position in spans if count == 1 and position}
        values = self.values
        if len(decoding) < 2 or values.score_function.layer_key(values.config, layer) is None:
            return set()
        kernel = values.kernels[layer]
        return decoding if kept.key_chunks(kernel, values.tables.row(kernel, next(iter(decoding)))[1]) else set()

    def earlier(self, layer: int, spans: list, values: bool = True) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per request past its first position, the keys and values before it, `[position, this rank's heads *
        dim]`, read from vLLM's paged cache (prefix-cached ones too), every request's at once (the values only if
        `values`)."""
        kernel = self.values.kernels[layer]
        past = [(request_id, position) for _, request_id, _, _, position in spans if position]
        if not past:
            return {}
        rows = [self.values.tables.row(kernel, request_id) for request_id, _ in past]
        read = kept.cached_many(
            kernel, [(table, position) for (table, _), (_, position) in zip(rows, past)], rows[0][1], values
        )
        return {request_id: found for (request_id, _), found in zip(past, read)}

    def _patterns(self, layer: int, shorts: set[str], scored: list) -> None:
        """The rebuilt scores and pattern of each request (`scored`: its step's captures, queries, keys), with the
        family's score function; decode steps (one query each) of a family scoring the common layout's way in one
        batch, their keys left-padded and masked, each request's rows then its own copy. Where the queries and keys
        are this rank's heads (each rank scoring its own), so are the patterns (`_rebuilt`)."""
        values, config = self.values, self.values.config
        heads, function, sinks = values.geometry[layer], values.score_function, values.sinks.get(layer)
        single = [entry for entry in scored if entry[1].shape[2] == 1]
        if len(single) < 2 or function.layer_key(config, layer) is None:
            single = []
        for step, queries, keys in (entry for entry in scored if not any(entry is one for one in single)):
            scores = function.scores(heads, config, queries, keys, layer)
            built = _rebuilt(shorts, scores, function.softmax(scores, sinks))
            for short in shorts:
                step[f"{short}.{layer}"] = built[short]
        if not single:
            return
        lengths = [keys.shape[2] for _, _, keys in single]
        longest = max(lengths)
        _, kv_heads, _, dim = single[0][2].shape  # every head, or this rank's where it scores its own
        padded = single[0][2].new_zeros(len(single), kv_heads, longest, dim)
        for row, (_, _, keys) in enumerate(single):
            padded[row, :, longest - keys.shape[2] :] = keys[0]
        self._batch(layer, shorts, [(step, queries) for step, queries, _ in single], padded, lengths)

    def _decoded(self, layer: int, shorts: set[str], decoding: list, own: bool) -> None:
        """The patterns of decode steps (`decoding`: the step's captures, queries, vLLM's id, position, key row) in
        one batch, their keys read from the cache blocks straight into place (`kept.decode_keys`)."""
        values = self.values
        heads, kernel = values.geometry[layer], values.kernels[layer]
        tables = [values.tables.row(kernel, request_id) for _, _, request_id, _, _ in decoding]
        rows = [(table, position, now) for (table, _), (_, _, _, position, now) in zip(tables, decoding)]
        keys, lengths = kept.decode_keys(kernel, tables[0][1], rows)
        steps = [(step, queries) for step, queries, _, _, _ in decoding]
        self._batch(layer, shorts, steps, keys if own else gather_heads(keys, heads.num_kv_heads, 1), lengths)

    def _batch(self, layer: int, shorts: set[str], steps: list, keys: torch.Tensor, lengths: list[int]) -> None:
        """Scores and pattern of one query per request (`steps`: its step's captures and queries) against `keys`,
        `[requests, heads, longest, dim]`, each request's `lengths` of them at the end (left-padded and masked)."""
        queries = torch.cat([queries for _, queries in steps])
        built = _rebuilt(shorts, *decode_patterns(self.values, layer, queries, keys, lengths))
        longest = keys.shape[2]
        for row, ((step, _), length) in enumerate(zip(steps, lengths)):
            for short in shorts:
                found = built[short][row : row + 1]
                step[f"{short}.{layer}"] = (found if short == "attn_sinks" else found[..., longest - length :]).clone()

    def _projection_hook(self, layer: int):
        heads = self.values.geometry[layer]
        shorts = self.layers[layer]

        def hook(module, args, kwargs):
            premix = args[0] if args else next(iter(kwargs.values()))
            premix = premix.reshape(-1, premix.shape[-1])  # the Transformers backend keeps a batch axis of one
            for request, _, start, count, _ in self._spans():
                local = premix[start : start + count].unflatten(-1, (-1, heads.head_dim))[None]  # this rank's heads
                z = gather_heads(local.clone(), heads.num_heads, 2)
                for short in shorts & {"z", "premix"}:
                    request.steps[-1][f"{short}.{layer}"] = z if short == "z" else z.flatten(-2)

        return hook

    # --- taking the captures ---------------------------------------------------------------------------------

    def take(self, tags: list[str] | None = None) -> dict[str, dict]:
        """The captures of `tags` (every request held, if None), freed here: per tag, each step's first position
        and captures."""
        tags = list(self.requests) if tags is None else tags
        found = {}
        for tag in tags:  # vLLM tells the worker a request finished only at the next step: don't wait for it
            request = self.requests.pop(tag, None)
            if request is None:
                raise KeyError(f"no static captures for request {tag!r} (taken already, or never run)")
            found[tag] = {"positions": request.positions, "steps": request.steps, "ranked": sorted(self.ranked)}
        return found

    def stats(self) -> dict:
        return {
            "requests": len(self.requests),
            "running": len(self.tags),
            "bytes": sum(
                t.numel() * t.element_size() for r in self.requests.values() for s in r.steps for t in s.values()
            ),
        }


def install(runner: Any) -> StaticRecorder | None:
    """The recorder for an engine that declared static points (in `additional_config`), else None."""
    keys = (runner.vllm_config.additional_config or {}).get(CONFIG_KEY)
    return StaticRecorder(runner, list(keys)) if keys else None


def recorder(runner: Any) -> StaticRecorder:
    """The runner's recorder; on an engine without static points, one that records nothing itself (a tool taps the
    layers it reduces, `StaticRecorder.tap`) and follows only requests tagged for it."""
    if runner.attnlens_static is None:
        runner.attnlens_static = StaticRecorder(runner, [])
    return runner.attnlens_static


# --- the client's side -----------------------------------------------------------------------------------------------


def generate(model: Any, prompts: Any, **kwargs: Any) -> list[StaticResult]:
    """Plain vLLM requests (no trace) for `prompts` (a string or a list), with their static captures.

    Keyword arguments are sampling parameters in vLLM's or transformers' spelling (`max_new_tokens`, `do_sample`)."""
    from vllm import SamplingParams

    if not getattr(model, "static_points", None):
        raise RuntimeError(
            "this engine declared no static points: load it with StandardizedVLLM(..., static_points=[...])"
        )
    single = isinstance(prompts, (str, Mapping))  # a string or one of vLLM's prompt dicts
    prompts = [prompts] if single else list(prompts)
    media.check_prompts(model, prompts)
    sampling = model._sampling_kwargs(dict(kwargs))
    tags = [uuid.uuid4().hex for _ in prompts]
    params = [SamplingParams(**sampling, extra_args={CONFIG_KEY: tag}) for tag in tags]
    outputs = model.vllm_entrypoint.generate(prompts, params, use_tqdm=False)
    taken = joined(model.vllm_entrypoint.collective_rpc("attnlens_static_take", args=(tags,)), model.stages)
    results = [
        StaticResult(output, [Cache(step) for step in taken[tag]["steps"]], taken[tag]["positions"])
        for output, tag in zip(outputs, tags)
    ]
    return results[0] if single else results


def decode_patterns(values: Any, layer: int, queries: torch.Tensor, keys: torch.Tensor, lengths: list[int]) -> tuple:
    """Scores and (pattern, sink share) of one query per request (`queries` `[requests, heads, 1, dim]`) against
    `keys` `[requests, kv heads, longest, dim]`, each request's `lengths` of them at the end (left-padded, masked
    here), with the family's score function and the kernel's sink logits (`values`: the worker's `WorkerValues`)."""
    heads, function = values.geometry[layer], values.score_function
    longest = keys.shape[2]
    present = torch.arange(longest) >= longest - torch.tensor(lengths)[:, None]
    scores = function.scores(heads, values.config, queries, keys, layer, present)
    return scores, function.softmax(scores, values.sinks.get(layer))


def _rebuilt(shorts: set[str], scores: torch.Tensor, softmaxed: tuple) -> dict:
    """The rebuilt values captured (`shorts`) by name: every head, or this rank's where it scored its own (the
    client joins the ranks' heads when it takes them: `joined`)."""
    probabilities, sink = softmaxed
    built = {"attn_scores": scores, "attn_probs": probabilities, "attn_sinks": sink}
    return {short: built[short] for short in shorts}


def joined(per_rank: list[dict], stages: int = 1) -> dict:
    """Every rank's captures taken (`StaticRecorder.take`, in vLLM's rank order: pipeline stage by stage, each stage's
    tensor-parallel ranks in turn) as one: within a stage, the patterns each rank scored on its own heads (`ranked`)
    joined along the head axis, the rest every rank holds whole (its first rank's kept); then each step's captures
    of every stage's layers together (a stage records only its own blocks, and no step where it taps none)."""
    taken = {}
    for ranks in by_stage(per_rank, stages):
        for tag, found in ranks[0].items():
            for i, step in enumerate(found["steps"]):
                for key in found["ranked"]:
                    if key in step:
                        step[key] = torch.cat([rank[tag]["steps"][i][key] for rank in ranks], dim=1)
            whole = taken.setdefault(tag, found)
            if whole is not found and found["steps"]:
                if not whole["steps"]:
                    whole["positions"], whole["steps"] = found["positions"], [{} for _ in found["steps"]]
                for step, more in zip(whole["steps"], found["steps"], strict=True):
                    step.update(more)
    return taken
