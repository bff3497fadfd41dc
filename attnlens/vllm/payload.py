"""What travels between a trace and vLLM's worker: a trace's envoys, shipped once per trace, not once per invoke;
and the saved values home, each tensor as its bytes.

nnsight pickles each invoke's body (its worker) into its request on its own, and a body that names the model or a
module carries the envoy tree with it (hundreds of envoys: some 60 KB and 6 ms per invoke on SmolLM2, then as long
again to load in the worker). Here the client pickles the tree once per trace (`by_reference`), and while nnsight
pickles the invokes every envoy pickles as a reference into that tree (nnsight's persistent ids, which already keep
each module and the interleaver out of the payload). The worker loads a trace's tree from the first of its requests
to arrive (`Trees.arrive`), before nnsight loads their bodies, so every body of one trace reads the same envoys, as
the bodies of one trace do on the transformers engine.

nnsight pickles the saved values home with torch's own reduction, which writes each tensor's storage through
`torch.save` (a zip archive per tensor, some 35 us to write and 45 us to read). A trace saving a value every step of
every prompt saves thousands (2,048 in the benchmark: 0.16 s a trace). The worker's pickler here writes a CPU tensor
as its bytes, its dtype and its shape (`dumps_results`: 0.02 s for the same), and anything else as nnsight does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: The request's `extra_args` entry carrying its trace's tree: (the trace's name, the pickled tree).
KEY = "attnlens_envoys"
PREFIX = "attnlens-envoy:"


def _envoys(model: Any) -> dict[str, Any]:
    return dict(model.modules(names=True))


@contextmanager
def by_reference(model: Any) -> Iterator[tuple[str, bytes]]:
    """Within the block, each envoy of `model`'s tree pickles as a reference to its copy in the tree pickled here
    (yielded: the trace's name and the tree's bytes, for each request's `extra_args[KEY]`)."""
    from nnsight.intervention.serialization import dumps

    envoys = _envoys(model)
    name = uuid.uuid4().hex
    tree = dumps(envoys)  # by value: the references are set after
    for path, envoy in envoys.items():
        envoy.__dict__["_persistent_id"] = f"{PREFIX}{name}:{path}"
    try:
        yield name, tree
    finally:
        for envoy in envoys.values():
            envoy.__dict__.pop("_persistent_id", None)


class _OnStage(dict):
    """nnsight's map of persistent ids on one of several pipeline stages: a module this stage does not hold (inside a
    block another stage holds, the last stage's logits processor) resolves to a placeholder (vLLM's
    `PPMissingLayer`), so a trace's tree of the whole model loads on every stage (attnlens's own stage-aware bodies
    never read those: `stages.stage_aware`)."""

    def __init__(self, objects: dict) -> None:
        from vllm.model_executor.models.utils import PPMissingLayer

        super().__init__(objects)
        self.placeholder = PPMissingLayer()

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or (isinstance(key, str) and key.startswith("Module:"))

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(key) if super().__contains__(key) else self.placeholder


def on_stage(objects: dict, stages: int) -> dict:
    """`objects` (nnsight's map of persistent ids) as a stage's of `stages` pipeline stages (`_OnStage`)."""
    return _OnStage(objects) if stages > 1 else objects


class Trees:
    """The worker's side: each running trace's envoys, loaded once, resolvable by nnsight while it loads the requests'
    bodies (entries in its map of persistent ids, `objects`), dropped once none of the trace's requests is live."""

    def __init__(self, objects: dict) -> None:
        self.objects = objects  # nnsight's map: persistent id -> this worker's object
        self.requests: dict[str, set[str]] = {}  # trace -> its live requests
        self.ids: dict[str, list[str]] = {}  # trace -> the persistent ids its tree added

    def arrive(self, scheduler_output: Any) -> None:
        """Load the tree of each trace whose request arrives this step and has none loaded (before nnsight loads
        the requests' bodies)."""
        from nnsight.intervention.serialization import loads

        for data in scheduler_output.scheduled_new_reqs:
            shipped = (getattr(data.sampling_params, "extra_args", None) or {}).get(KEY)
            if shipped is None:
                continue
            name, tree = shipped
            if name not in self.requests:
                found = {f"{PREFIX}{name}:{path}": envoy for path, envoy in loads(tree, self.objects).items()}
                self.objects.update(found)
                self.ids[name] = list(found)
            self.requests.setdefault(name, set()).add(data.req_id)

    def prune(self, live: Any) -> None:
        """Drop the trees none of whose requests is in `live` (the bodies already loaded keep their envoys)."""
        live = set(live)
        for name in [name for name, requests in self.requests.items() if not requests & live]:
            del self.requests[name]
            for key in self.ids.pop(name):
                self.objects.pop(key, None)


def _tensor(data: bytearray, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tensor `dumps_results` wrote: its bytes (owned by the tensor), read as `dtype` in `shape`."""
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def _as_bytes(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is written as its bytes: a plain CPU tensor, laid out in order, with nothing its bytes miss
    (a gradient, a conjugate or negative view, quantisation); the rest go as nnsight writes them."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout is torch.strided
        and tensor.is_contiguous()
        and not (tensor.requires_grad or tensor.is_conj() or tensor.is_neg() or tensor.is_quantized)
    )


def dumps_results(value: Any) -> bytes:
    """nnsight's `dumps_compact` (a view of a larger storage is written as a copy of itself, not its whole storage),
    writing each tensor that `_as_bytes` takes as its own bytes, dtype and shape. Loads with plain `pickle.loads`
    wherever attnlens imports."""
    import io
    import pickle

    from nnsight.modeling.vllm.collect import _CompactPickler

    class ResultPickler(_CompactPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and _as_bytes(obj):
                flat = obj.detach().reshape(-1)
                if flat.stride() != (1,):  # one element at any stride (an expanded scalar) counts as contiguous
                    flat = flat.new_empty(flat.shape).copy_(flat)  # a clone would keep the stride
                return _tensor, (bytearray(flat.view(torch.uint8).numpy()), obj.dtype, obj.shape)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    ResultPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def send_results_as_bytes() -> None:
    """Have this worker's nnsight pickle the saved values home with `dumps_results`: its collect calls the
    `dumps_compact` of its runner's module, which has no other caller."""
    from nnsight.modeling.vllm.model_runners import GPUModelRunner

    GPUModelRunner.dumps_compact = dumps_results
