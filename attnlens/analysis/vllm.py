"""The analyses on `StandardizedVLLM`: the trace body runs in vLLM's worker, which reads its own weights there
(`prepare`), so only the terms leave it.

The client holds vLLM's modules on the meta device: it knows their classes (which form the final norm has), not
their weights. vLLM's output projection is a `RowParallelLinear` (`[hidden, heads * head_dim]`, `weight` as a
`Linear`'s), its norms `RMSNorm` (`weight * x / rms`) or `GemmaRMSNorm` (`(1 + weight) * ...`), its unembedding a
`ParallelLMHead` whose vocabulary is padded (the padding rows are dropped). Tensor parallelism shards the output
projection over heads, so the analyses refuse it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import Unavailable
from .norms import NormForm, _eps

#: vLLM's norm classes and the form each computes.
NORM_CLASSES = {
    "RMSNorm": ("RMSNorm", False, "weight"),
    "GemmaRMSNorm": ("RMSNorm with 1 + weight (Gemma)", False, "one_plus"),
    "LayerNorm": ("LayerNorm", True, "weight"),
}


def tensor_parallel(model) -> int:
    engine = getattr(model, "vllm_entrypoint", None)
    try:
        return int(engine.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
    except AttributeError:
        return 1


def final_norm_form(model) -> NormForm | str:
    """The final norm's form from its class (its weight is read in the worker), or why it has none."""
    if tensor_parallel(model) > 1:
        return (
            "tensor parallelism shards the output projection over heads; the analyses run on one rank "
            "(tensor_parallel_size=1)"
        )
    module = model._module.get_submodule(model.family.path("final_norm", "vllm"))
    name = type(module).__name__
    if name not in NORM_CLASSES:
        return f"vLLM's final norm {name} is neither an RMSNorm nor a LayerNorm attnlens can freeze at the run's scale"
    form, centred, enters = NORM_CLASSES[name]
    return NormForm(form, name, centred, torch.empty(0), None, _eps(module), enters)


def projection_weights(projection, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's output projection as [hidden, width] and its bias, read by running its own matmul (`quant_method`) on the
    identity: vLLM's CPU backend packs the weight for its kernels and leaves `weight` empty."""
    weight = projection.weight
    basis = torch.eye(width, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        matrix = projection.quant_method.apply(projection, basis, None).float().T.contiguous()
    bias = getattr(projection, "bias", None)
    return matrix, None if bias is None else bias.detach().float()


def unembedding(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's unembedding (`module`: its model, in the worker)."""
    head = getattr(module, "lm_head", None)
    if head is None or getattr(head, "weight", None) is None:
        raise Unavailable("attribution on vLLM: the model has no lm_head to read tokens with")
    return head.weight, getattr(head, "bias", None)


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
