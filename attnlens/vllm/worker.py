"""What runs inside vLLM's worker: the runner and worker classes, the kept keys and values, the CPU adapter.

nnsight's vLLM integration runs a trace's body inside the worker, on the real weights, through its model runner.
attnlens adds one thing to that runner: for every request an attnlens trace submitted, it keeps the keys and values
vLLM's attention kernel receives, layer by layer and step by step, so that a decode step's pattern can be rebuilt
over the whole context. vLLM's own KV cache holds them too, but paged and in a backend-specific layout; a copy in
the kernel's own layout is simple and the same on every backend. They are freed when the request ends.

The recording sits in the interleaver's handoff (`handle`), after the trace's body has seen the kernel's inputs, so
what is kept is what the kernel received, edits included.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import torch
from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

from ..errors import LocationDrift
from ..family import Family, family_for

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


class History:
    """One request's kept keys and values: per layer, rows in the kernel's layout `[tokens, heads * dim]`.

    Buffers double when full, so keeping a decode step's row costs a copy of that row, not of the whole context.
    """

    def __init__(self) -> None:
        self.layers: dict[int, list[torch.Tensor]] = {}
        self.filled: dict[int, int] = {}

    def keep(self, layer: int, position: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        end = position + keys.shape[0]
        kept = self.layers.get(layer)
        if kept is None or kept[0].shape[0] < end:
            capacity = max(end, 2 * (kept[0].shape[0] if kept else 0), 16)
            grown = [x.new_empty((capacity, x.shape[1])) for x in (keys, values)]
            if kept is not None:
                for new, old in zip(grown, kept):
                    new[:position] = old[:position]
            self.layers[layer] = kept = grown
        kept[0][position:end] = keys
        kept[1][position:end] = values
        self.filled[layer] = end

    def before(self, layer: int, position: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of the tokens before `position` (None before any was kept)."""
        if position == 0:
            return None
        if self.filled.get(layer, 0) < position:
            raise RuntimeError(
                f"attnlens kept {self.filled.get(layer, 0)} of the {position} earlier tokens' keys at layer {layer}: "
                f"the kernel never received the others (prefix caching serves them from vLLM's cache without a "
                f"forward); leave enable_prefix_caching off, as nnsight does by default"
            )
        kept = self.layers[layer]
        return kept[0][:position], kept[1][:position]

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for kept in self.layers.values() for x in kept)

    def free(self) -> None:
        self.layers.clear()
        self.filled.clear()


class RequestState:
    """What attnlens keeps for one request in the worker: its history, this step's first position, and the
    patterns handed out this step (to recompute head outputs from if they were edited)."""

    def __init__(self) -> None:
        self.history = History()
        self.position = 0
        self.patterns: dict[int, dict] = {}


def _gather_heads(x: torch.Tensor, total: int, dim: int) -> torch.Tensor:
    """Under tensor parallelism each rank's kernel sees its own heads; gather them all (every rank runs the block,
    so every rank reaches this collective). Key/value heads replicated across ranks are taken once."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

    ranks = get_tensor_model_parallel_world_size()
    if ranks == 1:
        return x
    x = tensor_model_parallel_all_gather(x.contiguous(), dim=dim)
    if x.shape[dim] > total:  # replicated: rank r holds head r // (ranks // total)
        x = x.unflatten(dim, (total, -1)).select(dim + 1, 0)
    return x


def _local_heads(x: torch.Tensor, total: int, dim: int) -> torch.Tensor:
    """This rank's heads of a whole tensor (the inverse of `_gather_heads`, for writes)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    ranks = get_tensor_model_parallel_world_size()
    if ranks == 1:
        return x
    rank = get_tensor_model_parallel_rank()
    if total < ranks:
        return x.narrow(dim, rank // (ranks // total), 1)
    local = total // ranks
    return x.narrow(dim, rank * local, local)


class WorkerValues:
    """The worker's side of attnlens: per-layer facts, the kept histories, and the handoff hooks."""

    def __init__(self, runner: Any) -> None:
        config = runner.model_config.hf_config
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        named = (runner.vllm_config.additional_config or {}).get("attnlens_family")
        if named:
            module, _, qualname = named.partition(":")
            self.family: Family = getattr(importlib.import_module(module), qualname)()
        else:
            self.family = family_for(self.config.model_type)
        root = runner.nnsight_model
        modules = self.family.vllm_modules()
        layers = _child(root, modules["layers"])
        self.kernels: dict[str, int] = {}
        self.projections: dict[str, int] = {}
        self.shims: dict[int, SimpleNamespace] = {}
        for index, layer in enumerate(layers):
            kernel = _child(layer, modules["kernel"])
            self.kernels[f"{kernel.path}.input"] = index
            self.projections[f"{_child(layer, modules['output_projection']).path}.input"] = index
            self.shims[index] = self._shim(kernel._module, index)
        self.states: dict[str, RequestState] = {}
        self.spans: list[tuple[RequestState, int, int]] = []

    def _shim(self, kernel: torch.nn.Module, layer: int) -> SimpleNamespace:
        """What the family's score function reads off an attention module, from vLLM's kernel and the config;
        checked against the kernel so a family that disagrees with vLLM fails at load, not with a wrong pattern."""
        impl = kernel.impl
        facts = {
            "sliding window": (self.family.sliding_window(self.config, layer), _none_if(impl.sliding_window, -1)),
            "soft-cap": (self.family.softcap(self.config, layer), _none_if(impl.logits_soft_cap, 0)),
        }
        for what, (family_says, vllm_says) in facts.items():
            if family_says != vllm_says:
                raise LocationDrift(
                    f"family {self.family.name}, layer {layer}: the family's {what} is {family_says!r} but vLLM's "
                    f"kernel uses {vllm_says!r}; the rebuilt pattern would be wrong. Fix the family's {what}."
                )
        heads = self.config.num_attention_heads
        return SimpleNamespace(
            config=self.config, scaling=float(impl.scale), head_dim=kernel.head_size,
            num_heads=heads, num_kv_heads=getattr(self.config, "num_key_value_heads", None) or heads,
        )

    # --- scheduling: which requests are in this step, where their tokens are, what to free -----------------

    def schedule(self, runner: Any, scheduler_output: Any) -> None:
        requests = runner.nnsight_requests.requests
        for data in scheduler_output.scheduled_new_reqs:
            extra = getattr(data.sampling_params, "extra_args", None) or {}
            request = requests.get(data.req_id)
            if extra.get("attnlens") and request is not None and request.mediator is not None:
                state = self.states.setdefault(data.req_id, RequestState())
                request.mediator.attnlens_state = state
        self.prune(requests)
        tokens = scheduler_output.num_scheduled_tokens
        self.spans, start = [], 0
        for request_id in runner.input_batch.req_ids:
            if request_id not in tokens:
                continue
            state = self.states.get(request_id)
            if state is not None:
                # after a preemption vLLM recomputes from here; kept rows past it are overwritten
                state.position = runner.requests[request_id].num_computed_tokens
                state.patterns.clear()
                self.spans.append((state, start, tokens[request_id]))
            start += tokens[request_id]

    def prune(self, live: dict) -> None:
        """Free the histories of requests nnsight no longer tracks (finished, collected or aborted)."""
        for request_id in [r for r in self.states if r not in live]:
            self.states.pop(request_id).history.free()

    def stats(self) -> dict:
        return {"requests": len(self.states), "bytes": sum(s.history.nbytes for s in self.states.values())}

    # --- the handoff --------------------------------------------------------------------------------------

    def after_kernel_input(self, layer: int, value: Any) -> None:
        args, kwargs = value
        keys = args[1] if len(args) > 1 else kwargs["key"]
        values = args[2] if len(args) > 2 else kwargs["value"]
        for state, start, count in self.spans:
            state.history.keep(layer, state.position, keys[start:start + count].reshape(count, -1),
                               values[start:start + count].reshape(count, -1))

    def before_output_projection(self, layer: int, value: Any) -> None:
        """Recompute head outputs from a pattern edited this step, from the kept values (edits included)."""
        for state, start, count in self.spans:
            handed = state.patterns.pop(layer, None)
            if handed is None:
                continue
            pattern = handed.get("assigned")
            if pattern is None:
                probabilities, scores = handed.get("probabilities"), handed.get("scores")
                if probabilities is not None and probabilities._version != handed["probabilities_version"]:
                    pattern = probabilities
                elif scores is not None and scores._version != handed["scores_version"]:
                    pattern = scores.softmax(-1, dtype=torch.float32).to(scores.dtype)
            if pattern is None:
                continue
            heads = self.heads_from_pattern(state, layer, pattern)
            premix = value[0][0]  # (args, kwargs) of the output projection
            premix[start:start + count] = heads.reshape(count, -1).to(premix.dtype)

    def heads_from_pattern(self, state: RequestState, layer: int, pattern: torch.Tensor) -> torch.Tensor:
        """`pattern @ values` over the kept values, this rank's heads: [tokens, heads, head_dim]."""
        shim = self.shims[layer]
        end = state.position + pattern.shape[2]
        values = state.history.layers[layer][1][:end]
        values = values.view(end, -1, shim.head_dim).transpose(0, 1)[None]  # [1, local kv heads, keys, dim]
        pattern = _local_heads(pattern, shim.num_heads, 1)
        groups = pattern.shape[1] // values.shape[1]
        return (pattern.to(values.dtype) @ values.repeat_interleave(groups, dim=1))[0].transpose(0, 1)


def _none_if(value: Any, sentinel: Any) -> Any:
    return None if value is None or value == sentinel else value


def _child(envoy: Any, path: str) -> Any:
    for part in filter(None, path.split(".")):
        envoy = getattr(envoy, part)
    return envoy


def _recording(base: type) -> type:
    """The runner's interleaver class, with attnlens's two handoff hooks."""

    class RecordingInterleaver(base):
        def handle(self, provider: str, value: Any) -> Any:
            values = self.attnlens
            if values.spans:
                layer = values.projections.get(provider)
                if layer is not None:
                    values.before_output_projection(layer, value)
                    return super().handle(provider, value)
                layer = values.kernels.get(provider)
                if layer is not None:
                    value = super().handle(provider, value)
                    values.after_kernel_input(layer, value)
                    return value
            return super().handle(provider, value)

    RecordingInterleaver.__name__ = f"Recording{base.__name__}"
    return RecordingInterleaver


class AttnlensRunner:
    """Mixed in front of nnsight's model runner: builds `WorkerValues` and keeps it told what each step holds."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        interleaver = self.nnsight_model.interleaver
        interleaver.__class__ = _recording(type(interleaver))
        interleaver.attnlens = self.attnlens = WorkerValues(self)
        from . import static

        self.attnlens_static = static.install(self)

    def _update_states(self, scheduler_output: Any) -> None:
        super()._update_states(scheduler_output)
        self.attnlens.schedule(self, scheduler_output)
        if self.attnlens_static is not None:
            self.attnlens_static.schedule(scheduler_output)

    def collect_nnsight(self, *args: Any, **kwargs: Any) -> Any:
        collected = super().collect_nnsight(*args, **kwargs)
        self.attnlens.prune(self.nnsight_requests.requests)
        return collected


class AttnlensGPURunner(AttnlensRunner, NNsightGPUModelRunner):
    pass


class _WorkerRPC:
    def attnlens_stats(self) -> dict:
        """Live request histories and their bytes, for `StandardizedVLLM.kept()` (via `collective_rpc`)."""
        return self.model_runner.attnlens.stats()

    def attnlens_static_take(self, tags: list | None = None) -> dict:
        """The static captures of these requests (`static.generate`, via `collective_rpc`), freed in the worker."""
        return self.model_runner.attnlens_static.take(tags)


class GPUWorker(_WorkerRPC, NNsightGPUWorker):
    def init_device(self) -> None:
        super().init_device()
        self.model_runner.__class__ = AttnlensGPURunner


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
            _VLLMCPUWorker.init_device(self)
            runner = self.model_runner
            if type(runner).__name__ != "CPUModelRunner":
                raise NotImplementedError(
                    f"attnlens instruments vLLM's V1 CPUModelRunner, but this worker built {type(runner).__name__}; "
                    f"unset VLLM_USE_V2_MODEL_RUNNER"
                )
            runner.__class__ = _AttnlensCPURunner
