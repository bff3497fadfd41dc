"""The analyses on `StandardizedVLLM`: the trace body runs in vLLM's worker, which reads its own weights there
(`prepare`), so only the terms leave it.

The client holds vLLM's modules on the meta device: it knows their classes (which form the final norm has), not
their weights. vLLM's output projection is a `RowParallelLinear` (`[hidden, heads * head_dim]`, `weight` as a
`Linear`'s), its norms `RMSNorm` (`weight * x / rms`) or `GemmaRMSNorm` (`(1 + weight) * ...`), its unembedding a
`ParallelLMHead` whose vocabulary is padded (the padding rows are dropped). Under tensor parallelism each rank holds
its heads' columns of the output projection and its share of the vocabulary: every rank gathers the whole matrices
(once per weights, as on one rank), while the values the sums read are already every rank's heads (views.py).
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..errors import Unavailable
from ..locations.views import tensor_parallel
from .norms import NormForm, _eps

#: vLLM's norm classes and the form each computes.
NORM_CLASSES = {
    "RMSNorm": ("RMSNorm", False, "weight"),
    "GemmaRMSNorm": ("RMSNorm with 1 + weight (Gemma)", False, "one_plus"),
    "LayerNorm": ("LayerNorm", True, "weight"),
}


def final_norm_form(model) -> NormForm | str:
    """The final norm's form from its class (its weight is read in the worker), or why it has none."""
    module = model._module.get_submodule(model.family.path("final_norm", "vllm"))
    name = type(module).__name__
    if name not in NORM_CLASSES:
        return f"vLLM's final norm {name} is neither an RMSNorm nor a LayerNorm attnlens can freeze at the run's scale"
    form, centred, enters = NORM_CLASSES[name]
    return NormForm(form, name, centred, torch.empty(0), None, _eps(module), enters)


#: Per output projection module of this worker: its weights' identity and the matrix read from them. Reading the
#: matrix runs vLLM's matmul on the identity, so it is done once per weights, not per call; the identity changes when
#: vLLM packs the weights anew (a new `cpu_linear` kernel) or the weight tensor is edited in place (its version).
_MATRICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_identity(projection) -> tuple:
    weight = projection.weight
    return getattr(projection, "cpu_linear", None), weight.data_ptr(), weight._version, tuple(weight.shape)


def _gathered(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every tensor-parallel rank's share of `x` joined along `dim`, in rank order (each rank calls it: the worker
    runs the same body on every rank)."""
    if tensor_parallel()[0] == 1:
        return x
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(x.contiguous(), dim=dim)


def _cached(module, read) -> torch.Tensor:
    """`read()` of `module`'s weights, kept until they change."""
    identity = _weights_identity(module)
    cached = _MATRICES.get(module)
    if cached is None or cached[0] != identity:  # the kernel is compared by identity (functions' equality), held
        cached = _MATRICES[module] = (identity, read())
    return cached[1]


def projection_weights(projection, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's output projection as [hidden, width] and its bias, read by running its own matmul (`quant_method`) on the
    identity: vLLM's CPU backend packs the weight for its kernels and leaves `weight` empty. Under tensor parallelism
    each rank reads its heads' columns and the ranks' are joined. Cached per weights."""

    def read() -> torch.Tensor:
        weight = projection.weight
        local = getattr(projection, "input_size_per_partition", width)  # this rank's heads * head_dim
        basis = torch.eye(local, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            matrix = projection.quant_method.apply(projection, basis, None).float().T.contiguous()
        return _gathered(matrix, 1)

    bias = getattr(projection, "bias", None)  # whole on every rank (the all-reduce adds it once)
    return _cached(projection, read), None if bias is None else bias.detach().float()


def unembedding(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's unembedding (`module`: its model, in the worker), its padded vocabulary whole on every rank."""
    head = getattr(module, "lm_head", None)
    if head is None or getattr(head, "weight", None) is None:
        raise Unavailable("attribution on vLLM: the model has no lm_head to read tokens with")
    bias = getattr(head, "bias", None)
    if tensor_parallel()[0] == 1:
        return head.weight, bias
    return _cached(head, lambda: _gathered(head.weight.detach(), 0)), None if bias is None else _gathered(bias, 0)


def prepare(model, plan, prepare_weights) -> None:
    """In the worker: the final norm's weights, then the unembedding and the output projections (`prepare_weights`:
    `attribution.prepare`, passed in so this module need not import it back)."""
    module = model._module.get_submodule(plan.paths["final_norm"])
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    gain = (
        torch.ones(plan.directions.shape[-1] if plan.directions is not None else module.weight.shape[-1])
        if weight is None
        else weight.detach().float() + (1 if plan.final.enters == "one_plus" else 0)
    )
    plan.final = replace(plan.final, gain=gain, bias=None if bias is None else bias.detach().float())
    prepare_weights(model, plan)


def run_attribution(model, ids: torch.Tensor, plan, prepare_weights, collect) -> dict:
    """One request of `ids`, its prefill only; the terms computed in the worker (`collect`: `attribution.collect`)."""
    with torch.no_grad(), model.trace(ids.tolist(), max_tokens=1, temperature=0.0):
        found = [{}].save()
        prepare(model, plan, prepare_weights)
        collect(model, plan, found[0])
    return found[0]
