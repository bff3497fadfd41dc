"""`StandardizedVLLM`: a vLLM engine under nnsight, with the same value names and layouts as the eager class.

A trace's body runs inside vLLM's worker (nnsight ships it there with each request), so every read below runs there
too, on the real tensors: a value is read off the module where vLLM holds it and put in the eager layout, with a
batch axis of one (each invoke is one request). Scores and probabilities are rebuilt from the queries and keys the
attention kernel receives, with the family's own score function, over the keys attnlens keeps for the request
(`worker.History`), so a decode step's pattern covers the whole context.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from greenlet import getcurrent
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import OutOfOrderError
from nnsight.modeling.vllm import VLLM

from ..errors import EditError, OrderError, Unavailable, UnknownFamily
from ..family import Family, family_for
from ..support import Support
from ..values import ALL_VALUES, BY_NAME, LAYER_VALUES, Value
from . import static, worker

#: Where each value is read, as (role in `Family.vllm_modules()` or "" for the envoy itself, side), in forward order.
#: Values sharing a place share an `order()` rank.
PLACES: dict[str, tuple[str, str]] = {
    "embeddings": ("layers.0", "input"),
    "layer_input": ("", "input"),
    "attention_norm_output": ("attention_norm", "output"),
    "attention_queries": ("kernel", "input"),
    "attention_keys": ("kernel", "input"),
    "attention_values": ("kernel", "input"),
    "attention_scores": ("kernel", "input"),
    "attention_probabilities": ("kernel", "input"),
    "attention_head_outputs": ("output_projection", "input"),
    "attention_premix": ("output_projection", "input"),
    "attention_output": ("attention", "output"),
    "layer_mid": ("mlp_norm", "input"),
    "mlp_norm_output": ("mlp", "input"),
    "mlp_input": ("mlp", "input"),
    "mlp_neurons": ("down_projection", "input"),
    "mlp_output": ("mlp", "output"),
    "layer_output": ("", "output"),
    "final_norm_output": ("final_norm", "output"),
    "logits": ("logits", "output"),
}

RESIDUAL_PAIR = ("layer_input", "layer_mid", "layer_output", "embeddings")

NOTES = {
    "attention_queries": "what vLLM's attention kernel receives (after rotary embedding and any QK-norm)",
    "attention_keys": "the kernel's keys; on a decode step the whole context: the rows attnlens kept from earlier "
                      "steps, then this step's (a new tensor there: assign it). Edits reach the forward for this step's rows "
                      "only",
    "attention_values": "as the keys: the whole context on a decode step, this step's rows editable",
    "attention_scores": "rebuilt in vLLM's worker with the family's score function over the kept keys; editing "
                        "them recomputes this layer's head outputs from softmax(edited scores) and the kept values",
    "attention_probabilities": "rebuilt in vLLM's worker (softmax of the rebuilt scores); editing them recomputes "
                               "this layer's head outputs as edited pattern @ kept values",
    "attention_head_outputs": "the output projection's input, split into heads",
    "layer_input": "vLLM carries the residual stream as a (hidden, residual) pair: this is their sum, a new tensor; "
                   "assign it to edit (in-place edits of the sum do not reach the model)",
    "layer_mid": "the sum of the (hidden, residual) pair entering the MLP's norm; assign it to edit",
    "layer_output": "the sum of the block's (hidden, residual) output pair; assign it to edit",
    "embeddings": "the first block's input (any embedding scale included); assign it to edit",
    "attention_output": "a copy (vLLM's fused residual norm overwrites the buffer); assign it to edit",
    "mlp_output": "a copy (vLLM's fused residual norm overwrites the buffer); assign it to edit",
    "logits": "the sampled position only: [1, 1, vocab] per step",
}


def reasons(family: Family, config: Any, layer: int | None) -> dict[str, str]:
    """Value name -> why the vLLM backend cannot serve it on `family`; values absent here are served."""
    locations = family.locations_for(config, layer)
    found = {}
    for value in ALL_VALUES:
        if value.name not in locations:
            found[value.name] = family.absent.get(value.name) or Family.absent.get(value.name) or \
                f"the {family.name} family has no {value.name.replace('_', ' ')}"
        elif value.name not in PLACES:
            found[value.name] = "not yet served by attnlens's vLLM backend"
    found.update(family.vllm_unavailable(config, 0 if layer is None else layer))
    return found


def _layer_of(envoy: Envoy) -> int:
    return int(re.search(r"layers\.(\d+)", envoy.path).group(1))


def _child(envoy: Any, path: str) -> Any:
    for part in filter(None, path.split(".")):
        envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
    return envoy


def _state() -> worker.RequestState:
    mediator = getattr(getcurrent(), "mediator", None)
    state = getattr(mediator() if mediator is not None else None, "attnlens_state", None)
    if state is None:
        raise RuntimeError("attnlens keeps no history for this request; trace it through StandardizedVLLM")
    return state


def _pair_sum(args: tuple, kwargs: dict, first: int) -> torch.Tensor:
    hidden = args[first] if len(args) > first else kwargs["hidden_states"]
    residual = args[first + 1] if len(args) > first + 1 else kwargs.get("residual")
    return hidden if residual is None else hidden + residual


def _pair_replaced(args: tuple, kwargs: dict, first: int, new: torch.Tensor) -> tuple[tuple, dict]:
    """The (hidden, residual) arguments replaced by (new, 0): the fused norm adds them, so the stream is `new`."""
    args, kwargs = list(args), dict(kwargs)
    if len(args) > first:
        args[first] = new
    else:
        kwargs["hidden_states"] = new
    if len(args) > first + 1:
        args[first + 1] = None if args[first + 1] is None else torch.zeros_like(new)
    elif kwargs.get("residual") is not None:
        kwargs["residual"] = torch.zeros_like(new)
    return tuple(args), kwargs


class Reader:
    """Reads and writes one value inside the worker (in the trace body's greenlet)."""

    def __init__(self, envoy: Envoy, name: str, layer: int | None):
        self.envoy, self.name, self.layer = envoy, name, layer
        self.values: worker.WorkerValues = envoy.interleaver.attnlens
        self.modules = self.values.family.vllm_modules()

    def place(self, role: str) -> Envoy:
        if role == "layers.0":
            return _child(self.envoy, self.modules["layers"])[0]
        if role == "final_norm":
            return _child(self.envoy, self.modules["final_norm"])
        if not role:
            return self.envoy
        path = self.modules[role]
        scope = {"attention": self.modules["attention"], "mlp": self.modules["mlp"]}.get(BY_NAME[self.name].scope)
        if scope is not None:  # the envoy is the attention block or the MLP; paths are from the block
            path = "" if path == scope else path.removeprefix(scope + ".")
        return _child(self.envoy, path)

    # --- the attention kernel ------------------------------------------------------------------------------

    def kernel(self) -> tuple[Envoy, list, dict]:
        kernel = self.place("kernel")
        args, kwargs = kernel.inputs
        return kernel, list(args), dict(kwargs)

    def heads(self, flat: torch.Tensor, total: int) -> torch.Tensor:
        """[tokens, heads * dim] -> [1, heads, tokens, dim], all heads (a view on one rank)."""
        shim = self.values.shims[self.layer]
        x = flat.view(flat.shape[0], -1, shim.head_dim).transpose(0, 1)[None]
        return worker._gather_heads(x, total, 1)

    def context(self, which: int, flat: torch.Tensor) -> torch.Tensor:
        """Keys (1) or values (2) of the whole context: the kept earlier rows, then this step's."""
        shim = self.values.shims[self.layer]
        state = _state()
        current = self.heads(flat, shim.num_kv_heads)
        before = state.history.before(self.layer, state.position)
        if before is None:
            return current
        return torch.cat([self.heads(before[which - 1], shim.num_kv_heads), current], dim=2)

    def pattern(self, args: list) -> tuple[torch.Tensor, torch.Tensor]:
        shim = self.values.shims[self.layer]
        queries = self.heads(args[0], shim.num_heads)
        keys = self.context(1, args[1])
        # outside inference mode, so the tensors count in-place edits (`_version`): an edited pattern is noticed
        with torch.inference_mode(False), torch.no_grad():
            scores = self.values.family.scores(shim, queries, keys, self.layer)
            probabilities = scores.softmax(-1, dtype=torch.float32).to(scores.dtype)
        handed = _state().patterns.setdefault(self.layer, {})
        handed.update(scores=scores, scores_version=scores._version, probabilities=probabilities,
                      probabilities_version=probabilities._version)
        return scores, probabilities

    # --- read and write -------------------------------------------------------------------------------------

    def read(self) -> torch.Tensor:
        name = self.name
        if name.startswith("attention_") and PLACES[name][0] == "kernel":
            _, args, _ = self.kernel()
            shim = self.values.shims[self.layer]
            if name == "attention_queries":
                return self.heads(args[0], shim.num_heads)
            if name in ("attention_keys", "attention_values"):
                return self.context(1 if name == "attention_keys" else 2, args[1 if name == "attention_keys" else 2])
            scores, probabilities = self.pattern(args)
            return scores if name == "attention_scores" else probabilities
        if name == "logits":
            return VLLM.logits.__get__(self.envoy)[:, None]
        role, side = PLACES[name]
        place = self.place(role)
        if side == "input":
            args, kwargs = place.inputs
            if name in RESIDUAL_PAIR:
                return _pair_sum(args, kwargs, 1 if role in ("", "layers.0") else 0)[None]
            value = args[0] if args else next(iter(kwargs.values()))
        else:
            value = place.output
            if name == "layer_output":
                return _pair_sum(value, {}, 0)[None]
            if isinstance(value, tuple):
                value = value[0]
            if name in ("attention_output", "mlp_output"):
                value = value.clone()
        if name == "attention_head_outputs":
            return value.view(value.shape[0], -1, self.values.shims[self.layer].head_dim)[None]
        return value[None]

    def write(self, new: torch.Tensor) -> None:
        name = self.name
        if name in ("attention_scores", "attention_probabilities"):
            self.kernel()  # at the kernel's handoff, as a read would be
            pattern = new if name == "attention_probabilities" else \
                new.softmax(-1, dtype=torch.float32).to(new.dtype)
            _state().patterns.setdefault(self.layer, {})["assigned"] = pattern
            return
        if name in ("attention_queries", "attention_keys", "attention_values"):
            kernel, args, kwargs = self.kernel()
            index = ("attention_queries", "attention_keys", "attention_values").index(name)
            shim = self.values.shims[self.layer]
            count = args[index].shape[0]
            if new.shape[2] > count:  # a decode step's whole context: only this step's rows reach the kernel
                kept = self.context(index, args[index])[:, :, :-count]
                if not torch.equal(new[:, :, :-count], kept.to(new.dtype)):
                    raise EditError(
                        f"layers[{self.layer}].self_attn.{name}: only this step's rows can be edited on a decode "
                        f"step; earlier rows are in vLLM's KV cache already. Edit them on the step that computed them."
                    )
                new = new[:, :, -count:]
            total = shim.num_heads if index == 0 else shim.num_kv_heads
            args[index] = worker._local_heads(new, total, 1)[0].transpose(0, 1).reshape(count, -1)
            kernel.inputs = (tuple(args), kwargs)
            return
        if name == "logits":
            VLLM.logits.__set__(self.envoy, new[:, -1])
            return
        role, side = PLACES[name]
        place = self.place(role)
        new = new[0]
        if name == "attention_head_outputs":
            new = new.reshape(new.shape[0], -1)
        if side == "input":
            args, kwargs = place.inputs
            if name in RESIDUAL_PAIR:
                place.inputs = _pair_replaced(args, kwargs, 1 if role in ("", "layers.0") else 0, new)
            elif args:
                place.inputs = ((new, *args[1:]), kwargs)
            else:
                key = next(iter(kwargs))
                place.inputs = (args, {**kwargs, key: new})
            return
        output = place.output
        if name == "layer_output":
            place.output = (new, torch.zeros_like(new))
        elif isinstance(output, tuple):
            place.output = (new, *output[1:])
        else:
            place.output = new


def _access(envoy: Envoy, name: str, layer: int | None, act):
    """Refuse an unavailable value; name the value when nnsight says it came too late."""
    values = getattr(envoy.interleaver, "attnlens", None)
    if values is None:
        raise RuntimeError("attnlens values are read inside vLLM's worker, in a trace of a StandardizedVLLM")
    reason = reasons(values.family, values.config, layer).get(name)
    described = name if layer is None else f"layers[{layer}].{BY_NAME[name].key}"
    if reason is not None:
        raise Unavailable(f"{described} on {values.family.name} (vLLM): {reason}")
    try:
        return act(Reader(envoy, name, layer))
    except AttributeError as error:  # inside a property, Python would retry through Envoy.__getattr__ and hide it
        raise RuntimeError(f"reading {described}: {error!r}") from error
    except OutOfOrderError as error:
        raise OrderError(
            f"{described} was requested after the forward pass had computed it; read values in forward order "
            f"(model.order(layer) gives it)"
        ) from error


def _value_property(value: Value) -> property:
    def layer(envoy):
        return None if value.scope == "model" else _layer_of(envoy)

    def read(envoy):
        return _access(envoy, value.name, layer(envoy), lambda reader: reader.read())

    def write(envoy, new):
        _access(envoy, value.name, layer(envoy), lambda reader: reader.write(new))

    return property(read, write, doc=f"{value.meaning} [{value.layout}]")


class VLLMLayerEnvoy(Envoy):
    """`model.layers[i]` on vLLM: the block's residual-stream values."""


class VLLMAttentionEnvoy(Envoy):
    """`model.layers[i].self_attn` on vLLM: the attention values and sizes."""

    num_heads = property(lambda self: self.root.text_config.num_attention_heads, doc="query heads")
    num_kv_heads = property(lambda self: getattr(self.root.text_config, "num_key_value_heads", None)
                            or self.root.text_config.num_attention_heads, doc="key/value heads")
    head_dim = property(lambda self: self.root.head_dim, doc="size of one head's values and outputs")
    qk_head_dim = head_dim


class VLLMMLPEnvoy(Envoy):
    """`model.layers[i].mlp` on vLLM."""


for _value in ALL_VALUES:
    _host = {"layer": VLLMLayerEnvoy, "attention": VLLMAttentionEnvoy, "mlp": VLLMMLPEnvoy}.get(_value.scope)
    if _host is not None:
        setattr(_host, _value.name, _value_property(_value))


class StandardizedVLLM(VLLM):
    """A vLLM engine under nnsight with attnlens's values on `layers[i]`, `.self_attn`, `.mlp` and the model.

    `model` is a local folder or hub name; other keyword arguments go to vLLM's engine (`dtype`, `max_model_len`,
    `tensor_parallel_size`, ...). Each `tracer.invoke(prompt)` is one request, with a batch axis of one.
    """

    def __init__(self, model: Any, family: Family | type[Family] | None = None, static_points: Any = None,
                 **kwargs: Any) -> None:
        from transformers import AutoConfig

        path = str(model)
        config = AutoConfig.from_pretrained(path)
        self.text_config = config.get_text_config()
        if family is None:
            try:
                family = family_for(self.text_config.model_type)
            except UnknownFamily:
                raise UnknownFamily(f"attnlens has no family for model type {self.text_config.model_type!r}; "
                                    f"register one (docs/extending.md)") from None
        self.family: Family = family() if isinstance(family, type) else family
        if self.text_config.model_type not in self.family.vllm_model_types:
            raise UnknownFamily(
                f"the {self.family.name} family's vLLM module names are not checked for model type "
                f"{self.text_config.model_type!r}; check them against vLLM's implementation, override "
                f"Family.vllm_modules if they differ, and add the type to vllm_model_types"
            )
        if not worker.has_accelerator():
            worker.adapt_client_for_cpu()
        family_class = type(self.family)
        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}),
                                       "attnlens_family": f"{family_class.__module__}:{family_class.__qualname__}"}
        self.static_points = static.declare(self, static_points) if static_points is not None else []
        if self.static_points:  # checked before the engine is built; the worker hooks them (static.py)
            kwargs["additional_config"][static.CONFIG_KEY] = self.static_points
        kwargs.setdefault("dispatch", True)
        f = self.family
        modules = f.vllm_modules()
        from nnsight.modeling.vllm.envoys import parallel_envoys

        envoys = {**parallel_envoys(), "layers.*": VLLMLayerEnvoy, f"layers.*.{modules['attention']}": VLLMAttentionEnvoy,
                  f"layers.*.{modules['mlp']}": VLLMMLPEnvoy}
        rename = {modules["layers"]: "layers"}
        if modules["attention"] != "self_attn":
            rename[modules["attention"]] = "self_attn"
        super().__init__(path, rename=rename, envoys=envoys, **kwargs)

    @property
    def _WORKER_CLS(self) -> str:  # read by nnsight when it builds the engine
        return worker.WORKER_GPU if worker.has_accelerator() else worker.WORKER_CPU

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def head_dim(self) -> int:
        c = self.text_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    # --- what is served, and in what order ------------------------------------------------------------------

    def _check_layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"layer must be an int in [0, {self.num_layers}); got {layer!r}")
        return layer % self.num_layers

    def support(self, layer: int = 0) -> Support:
        """Which values `layer` serves on vLLM and, for each it doesn't, why; notes say what is rebuilt."""
        layer = self._check_layer(layer)
        found = reasons(self.family, self.text_config, layer)
        report = {v.key: found.get(v.name) for v in LAYER_VALUES}
        report.update({v.name: found.get(v.name) for v in ALL_VALUES if v.scope == "model"})
        notes = {BY_NAME[n].key: note for n, note in self.family.notes(self.text_config, layer).items()}
        window = self.family.sliding_window(self.text_config, layer)
        if window is not None:
            notes["self_attn.attention_probabilities"] = (
                f"sliding window: each query sees its last {window} keys; rebuilt over the whole context (zeros "
                f"outside the window). " + NOTES["attention_probabilities"])
        for name, note in NOTES.items():
            notes.setdefault(BY_NAME[name].key, note)
        return Support(family=self.family.name, layer=layer, engine="vllm", reasons=report, notes=notes)

    def order(self, layer: int = 0) -> dict[str, int]:
        """Forward-order rank of every value of block `layer` served here; values read at one place share a rank."""
        self._check_layer(layer)
        found = reasons(self.family, self.text_config, layer)
        places: list[tuple[str, str]] = []
        ranks = {}
        for name, place in PLACES.items():
            if BY_NAME[name].scope == "model" or name in found:
                continue
            if place not in places:
                places.append(place)
            ranks[BY_NAME[name].key] = places.index(place)
        return ranks

    def kept(self) -> list[dict]:
        """Per worker: how many requests' keys and values attnlens keeps, and their bytes (0 once all ended)."""
        return self.vllm_entrypoint.collective_rpc("attnlens_stats")

    def static_generate(self, prompts: Any, **kwargs: Any) -> Any:
        """Plain vLLM requests with the static captures declared at load (`static.generate`)."""
        return static.generate(self, prompts, **kwargs)

    # --- requests ------------------------------------------------------------------------------------------

    def _attach_mediators(self, params: list, **kwargs: Any) -> list:
        attached = super()._attach_mediators(params, **kwargs)
        for param in params:  # tells the worker to keep this request's keys and values
            param.extra_args = {**(param.extra_args or {}), "attnlens": 1}
        return attached

    @staticmethod
    def _sampling_kwargs(kwargs: dict) -> dict:
        """transformers' spelling accepted too, so the same call runs on both engines."""
        kwargs = VLLM._sampling_kwargs(kwargs)
        if kwargs.pop("do_sample", None) is False:
            kwargs.setdefault("temperature", 0.0)
        kwargs.pop("pad_token_id", None)
        return kwargs


for _value in ALL_VALUES:
    if _value.scope == "model":
        setattr(StandardizedVLLM, _value.name, _value_property(_value))
