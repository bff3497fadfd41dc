"""The static capture backend on vLLM: taps declared when the engine loads, recorded on every request.

`StandardizedVLLM(path, static_points=["attn_probs.10", "value.10"])` checks the points against `support()` before
the engine is built, then vLLM's worker installs plain PyTorch forward pre-hooks on the modules that hold them. No
trace is shipped with a request and nnsight's interleaver has nothing to run, so requests take vLLM's ordinary path;
the hooks only copy this step's rows per request. `model.static_generate(prompts, ...)` runs plain vLLM requests and
returns each one's output with its captures, one `Cache` per step (step 0 the prefill, then one per decode step), in
the layouts `run_with_cache` gives (batch axis of one, as a traced invoke on vLLM gives).

Scores and probabilities are not taps of their own: declaring them taps their source, the kernel's queries and the
request's keys (kept with `worker.History`, as traced requests keep them), and they are rebuilt with the family's
score function when the captures are taken. Keys and values on a decode step span the whole context, as on the
traced path. A request's state is held in the worker from its first step until its captures are taken.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import torch

from .. import points as plan
from ..errors import Unavailable
from ..locations import child
from ..locations.views import gather_heads, gathered_heads
from ..locations.vllm import KernelInput, RebuiltPattern, kernel_arg
from ..names import Cache
from ..values import BY_NAME
from . import kept
from .blocks import attention_block, handoffs

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
        elif premix is not None and name in ("attention_head_outputs", "attention_premix") \
                and location.key == premix.key:
            found[BY_NAME[name].short] = "projection"
    return found


def declare(model: Any, names: Any) -> list[str]:
    """Check `names` (cache names, e.g. "attn_probs.10" or "attention_values.10") before the engine loads.

    Unknown names raise `KeyError`, values the family or vLLM cannot serve raise `attnlens.Unavailable` with
    `support()`'s reason, and values the static backend does not tap raise `Unavailable` naming the ones it does.
    Returns the declared cache keys, in forward order."""
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError("static_points is empty: name at least one tap, e.g. 'attn_probs.0'")
    points = plan.points(model, names)
    for short, layer in points:
        allowed = {} if layer is None else taps(model.family, model.text_config, layer)
        if layer is not None and not allowed:
            raise Unavailable(f"{short}.{layer} on {model.family.name}: layer {layer} has no attention kernel on vLLM, "
                              f"so no static taps; read its values with a trace")
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
    """One request: vLLM's `RequestOutput` and its captures, one `Cache` per step (0: the prefill)."""

    output: Any
    steps: list[Cache]

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
    """One request's captures in the worker: per step, its first position and row count and this step's rows."""

    def __init__(self) -> None:
        self.history = kept.History()
        self.steps: list[dict[str, Any]] = []


class StaticRecorder:
    """Installed in vLLM's worker when the engine declares static points: it runs before the tapped modules."""

    def __init__(self, runner: Any, keys: list[str]) -> None:
        self.runner = runner
        self.values = runner.attnlens  # WorkerValues: family, geometry
        self.keys = keys
        self.layers: dict[int, set[str]] = {}
        for key in keys:
            short, _, layer = key.rpartition(".")
            self.layers.setdefault(int(layer), set()).update((short, *SOURCES.get(short, ())))
        self.requests: dict[str, _Request] = {}  # by tag (or vLLM's request id)
        self.tags: dict[str, str] = {}  # vLLM's request id -> tag
        self.tokens: dict[str, int] = {}
        self.spans: list[tuple[_Request, int, int, int]] | None = []
        family, config = self.values.family, self.values.config
        layers = child(runner.nnsight_model, family.path("layers", "vllm"))
        for layer, shorts in self.layers.items():
            where = taps(family, config, layer)
            kernel, projection = handoffs(family, config, layer)
            attention = attention_block(family, layers[layer])
            if any(where.get(short) == "kernel" for short in shorts):
                _before_forward(child(attention, kernel)._module, self._kernel_hook(layer))
            if any(where.get(short) == "projection" for short in shorts):
                _before_forward(child(attention, projection)._module, self._projection_hook(layer))

    # --- scheduling ----------------------------------------------------------------------------------------

    def schedule(self, scheduler_output: Any) -> None:
        for data in scheduler_output.scheduled_new_reqs:
            extra = getattr(data.sampling_params, "extra_args", None) or {}
            tag = extra.get(CONFIG_KEY) or data.req_id
            self.tags[data.req_id] = tag
            self.requests[tag] = _Request()
        for request_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            self.finish(request_id)
        self.tokens = dict(scheduler_output.num_scheduled_tokens)
        self.spans = None  # worked out at the first hook, when the batch's order is final

    def finish(self, request_id: str) -> None:
        """The request is over: its captures stay until taken, its key history only as far as they need it."""
        self.tags.pop(request_id, None)

    def _spans(self) -> list[tuple[_Request, int, int, int]]:
        if self.spans is None:
            self.spans, start = [], 0
            for request_id in self.runner.input_batch.req_ids:
                count = self.tokens.get(request_id)
                if count is None:
                    continue
                request = self.requests.get(self.tags.get(request_id, ""))
                if request is not None:
                    position = self.runner.requests[request_id].num_computed_tokens
                    step = {"position": position, "count": count}
                    request.steps.append(step)
                    self.spans.append((request, start, count, position))
                start += count
        return self.spans

    # --- hooks -----------------------------------------------------------------------------------------------

    def _kernel_hook(self, layer: int):
        shorts = self.layers[layer]
        keep_keys = bool(shorts & {"key", "value", *SOURCES})

        def hook(module, args, kwargs):
            queries, keys, values = (kernel_arg(args, kwargs, which) for which in range(3))
            for request, start, count, position in self._spans():
                rows = slice(start, start + count)
                if keep_keys:
                    request.history.keep(layer, position, keys[rows].reshape(count, -1),
                                         values[rows].reshape(count, -1))
                if "query" in shorts:  # every rebuilt name taps its queries (SOURCES)
                    request.steps[-1][f"q.{layer}"] = queries[rows].reshape(count, -1).clone()
        return hook

    def _projection_hook(self, layer: int):
        def hook(module, args, kwargs):
            premix = args[0] if args else next(iter(kwargs.values()))
            premix = premix.reshape(-1, premix.shape[-1])  # the Transformers backend keeps a batch axis of one
            for request, start, count, _ in self._spans():
                request.steps[-1][f"premix.{layer}"] = premix[start:start + count].clone()
        return hook

    # --- taking the captures ---------------------------------------------------------------------------------

    def take(self, tags: list[str] | None = None) -> dict[str, list[dict[str, torch.Tensor]]]:
        """The captures of `tags` (every request held, if None), rebuilt into their layouts, and freed here."""
        tags = list(self.requests) if tags is None else tags
        found = {}
        for tag in tags:  # vLLM tells the worker a request finished only at the next step: don't wait for it
            request = self.requests.pop(tag, None)
            if request is None:
                raise KeyError(f"no static captures for request {tag!r} (taken already, or never run)")
            found[tag] = [self._step(request, step) for step in request.steps]
            request.history.free()
        return found

    def _step(self, request: _Request, step: dict) -> dict[str, torch.Tensor]:
        position, count = step["position"], step["count"]
        out = {}
        for key in self.keys:
            short, _, layer = key.rpartition(".")
            layer = int(layer)
            heads = self.values.geometry.get(layer)
            if short in ("key", "value", *SOURCES):
                request.history.before(layer, position)  # raises if the kernel never saw earlier tokens
                keys, values = (gathered_heads(request.history.upto(layer, position + count, which), dim,
                                                 heads.num_kv_heads)
                                for which, dim in ((0, heads.qk_head_dim), (1, heads.head_dim)))
            if short in ("z", "premix"):
                local = step[f"premix.{layer}"].unflatten(-1, (-1, heads.head_dim))[None]  # this rank's heads
                z = gather_heads(local, heads.num_heads, 2)
                out[key] = z if short == "z" else z.flatten(-2)
            elif short == "query":
                out[key] = gathered_heads(step[f"q.{layer}"], heads.qk_head_dim, heads.num_heads)
            elif short in ("key", "value"):
                out[key] = (keys if short == "key" else values).clone()
            else:
                queries = gathered_heads(step[f"q.{layer}"], heads.qk_head_dim, heads.num_heads)
                scores = self.values.family.scores(heads, self.values.config, queries, keys, layer)
                probabilities, sinks = self.values.family.softmax(scores, self.values.sinks.get(layer))
                out[key] = {"attn_scores": scores, "attn_probs": probabilities, "attn_sinks": sinks}[short]
        return out

    def stats(self) -> dict:
        return {"requests": len(self.requests), "running": len(self.tags),
                "bytes": sum(r.history.nbytes + sum(t.numel() * t.element_size() for s in r.steps
                                                     for t in s.values() if isinstance(t, torch.Tensor))
                             for r in self.requests.values())}


def install(runner: Any) -> StaticRecorder | None:
    """The recorder for an engine that declared static points (in `additional_config`), else None."""
    keys = (runner.vllm_config.additional_config or {}).get(CONFIG_KEY)
    return StaticRecorder(runner, list(keys)) if keys else None


# --- the client's side -----------------------------------------------------------------------------------------------


def generate(model: Any, prompts: Any, **kwargs: Any) -> list[StaticResult]:
    """Plain vLLM requests (no trace) for `prompts` (a string or a list), with their static captures.

    Keyword arguments are sampling parameters in vLLM's or transformers' spelling (`max_new_tokens`, `do_sample`)."""
    from vllm import SamplingParams

    if not getattr(model, "static_points", None):
        raise RuntimeError("this engine declared no static points: load it with StandardizedVLLM(..., "
                           "static_points=[...])")
    single = isinstance(prompts, str)
    prompts = [prompts] if single else list(prompts)
    sampling = model._sampling_kwargs(dict(kwargs))
    tags = [uuid.uuid4().hex for _ in prompts]
    params = [SamplingParams(**sampling, extra_args={CONFIG_KEY: tag}) for tag in tags]
    outputs = model.vllm_entrypoint.generate(prompts, params, use_tqdm=False)
    taken: dict = {}
    for per_worker in model.vllm_entrypoint.collective_rpc("attnlens_static_take", args=(tags,)):
        taken = per_worker  # every rank holds the same gathered captures; rank 0's are kept
        break
    results = [StaticResult(output, [Cache(step) for step in taken[tag]]) for output, tag in zip(outputs, tags)]
    return results[0] if single else results
